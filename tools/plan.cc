// SPDX-License-Identifier: Apache-2.0
// rp-plan job.toml --gpus N [--nnodes N] [--profile out/profile.json] [--set section.key=value ...]
// [--json] Prints the plan schedule.partition = "auto" would run, with the simulator's predictions
// from a measured profile (--profile, or schedule.profile) or the FLOP cost model. With partition =
// "equal" in the job it also shows the job's own plan under the same costs, and then no auto plan
// under schedule.gpu_memory_gb is no error: it says why in place of that plan
// (--json: "auto_plan_error" in place of its fields).
// --json prints one JSON object and nothing else.
//
// --max-seq: the longest data.seq_len (a multiple of --seq-step) whose plan fits
// schedule.gpu_memory_gb per worker (the planner's estimate) and whose shared memory fits
// --host-memory-gb (default: schedule.host_memory_gb, else this host's available memory), with
// the predicted tokens/s there; with partition = "auto" the planner chooses among the plans that
// fit both (fewer backward stages hold fewer checkpoints in host slots);
// with train.mlp_tile_tokens = -1 the MLP tile is chosen at each length as the run would.
// Lengths other than the job's are costed by the FLOP cost model (a profile is measured at one
// length).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>

#include <nlohmann/json.hpp>

#include "common/exit_codes.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "planning/partitioner.h"
#include "planning/plan.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace {

// What a job at one sequence length needs and is predicted to do (--max-seq).
struct LengthFit {
  bool fits = false;
  std::string why;  // what does not fit
  rp::core::PlanChoice choice;
  double host_bytes = 0.0;
  int64_t mlp_tile_tokens = 0;  // as resolved at this length
  int64_t kept_blocks = 0;      // likewise
  int64_t keep_attention = 0;   // likewise
};

LengthFit FitAt(rp::core::JobConfig c, int64_t seq_len, int gpus, double host_limit,
                const rp::core::DeviceModel& device) {
  LengthFit f;
  const bool measured_length = seq_len == c.data.seq_len;
  c.data.seq_len = seq_len;
  if (!measured_length) c.schedule.profile.clear();  // a profile holds one length's costs
  {
    // train.mlp_tile_tokens = -1 and the records' count: what the run would choose at this
    // length with this host limit, under both memories.
    rp::core::JobConfig limited = c;
    limited.schedule.host_memory_gb = host_limit / 1e9;
    if (auto s = rp::core::ResolveMlpTile(&limited, gpus, rp::shm::SharedBytesFor(gpus)); !s.ok()) {
      f.why = "memory (" + s.message() + ")";
      return f;
    }
    if (auto s = rp::core::ResolveKeptAttention(&limited, gpus, rp::shm::SharedBytesFor(gpus));
        !s.ok()) {
      f.why = s.message();
      return f;
    }
    c.train.mlp_tile_tokens = limited.train.mlp_tile_tokens;
    c.schedule.keep_attention = limited.schedule.keep_attention;
  }
  if (auto s = rp::core::ResolveKeptBlocks(&c, gpus); !s.ok()) {
    f.why = s.message();
    return f;
  }
  f.kept_blocks = c.schedule.kept_blocks;
  f.keep_attention = c.schedule.keep_attention;
  f.mlp_tile_tokens = c.train.mlp_tile_tokens;
  auto costs = rp::core::PlanningProfile(c, device);
  if (!costs.ok()) {
    f.why = costs.status().message();
    return f;
  }
  const rp::core::ExecutionPlan x = rp::core::ResolveExecution(c);
  if (x.planner_chooses_partition) {
    // The planner drops the plans above either memory.
    c.schedule.host_memory_gb = host_limit / 1e9;
    auto choice = rp::core::ChoosePlan(c, gpus, *costs, rp::shm::SharedBytesFor(gpus));
    if (!choice.ok()) {
      f.why = choice.status().message();
      return f;
    }
    f.choice = *choice;
  } else {
    auto plan = rp::core::BuildPlan(c);
    if (!plan.ok()) {
      f.why = plan.status().message();
      return f;
    }
    f.choice = rp::core::PredictPlan(c, *plan, *costs, gpus);
    if (f.choice.peak_memory_bytes > c.schedule.gpu_memory_gb * 1e9) {
      f.why = "device memory";
      return f;
    }
  }
  const auto spec = rp::core::BuildModelSpec(c.model, c.lora);
  auto layout = rp::shm::ComputeLayout(c, x, spec, f.choice.plan);
  if (!layout.ok()) {
    f.why = layout.status().message();
    return f;
  }
  f.host_bytes = static_cast<double>(rp::shm::SharedMemoryBytes(*layout, c, gpus));
  if (f.host_bytes > host_limit) {
    f.why = "host memory";
    return f;
  }
  f.fits = true;
  return f;
}

int MaxSeq(const rp::core::JobConfig& cfg, int gpus, int64_t step, double host_memory_gb, bool json,
           const rp::core::DeviceModel& device) {
  if (cfg.schedule.gpu_memory_gb <= 0) {
    std::fprintf(
        stderr,
        "rp-plan: --max-seq needs schedule.gpu_memory_gb, the device memory per worker to fit "
        "(--set schedule.gpu_memory_gb=...)\n");
    return rp::kExitBadConfig;
  }
  const double host_limit = host_memory_gb > 0 ? host_memory_gb * 1e9
                            : cfg.schedule.host_memory_gb > 0
                                ? cfg.schedule.host_memory_gb * 1e9
                                : static_cast<double>(rp::shm::AvailableHostMemory());
  // Doubling to the first length that does not fit, then bisection on multiples of `step`.
  constexpr int64_t kLongest = int64_t{1} << 20;  // data.seq_len's own bound
  int64_t lo = 0, hi = 0;
  LengthFit best;
  for (int64_t l = step; l <= kLongest; l *= 2) {
    LengthFit f = FitAt(cfg, l, gpus, host_limit, device);
    if (!f.fits) {
      hi = l;
      break;
    }
    lo = l;
    best = f;
  }
  if (lo == 0) {
    std::fprintf(stderr, "rp-plan: not even %lld tokens per sequence fit (%s)\n",
                 static_cast<long long>(step),
                 FitAt(cfg, step, gpus, host_limit, device).why.c_str());
    return rp::kExitBadConfig;
  }
  if (hi == 0) hi = kLongest + step;  // the longest searched fits
  while (hi - lo > step) {
    const int64_t mid = lo + (hi - lo) / 2 / step * step;
    LengthFit f = FitAt(cfg, mid, gpus, host_limit, device);
    if (f.fits) {
      lo = mid;
      best = f;
    } else {
      hi = mid;
    }
  }
  const rp::core::RoundShape whole = rp::core::GlobalRound(cfg);
  const double tokens =
      static_cast<double>(whole.calls * whole.microbatches * cfg.train.microbatch_size * lo);
  // Past data.seq_len's bound nothing is tried: that bound is the limit.
  const std::string limit = lo + step > kLongest
                                ? "data.seq_len's bound, " + std::to_string(kLongest) + " tokens"
                                : FitAt(cfg, lo + step, gpus, host_limit, device).why;
  if (json) {
    std::printf("%s\n",
                nlohmann::json{{"max_seq_len", lo},
                               {"plan", best.choice.plan.Describe()},
                               {"peak_memory_bytes_per_worker", best.choice.peak_memory_bytes},
                               {"gpu_memory_limit_bytes", cfg.schedule.gpu_memory_gb * 1e9},
                               {"host_bytes", best.host_bytes},
                               {"host_limit_bytes", host_limit},
                               {"predicted_step_s", best.choice.step_seconds},
                               {"predicted_tokens_per_s", tokens / best.choice.step_seconds},
                               {"costs", best.choice.cost_source},
                               {"device", device.name},
                               {"mlp_tile_tokens", best.mlp_tile_tokens},
                               {"kept_blocks", best.kept_blocks},
                               {"keep_attention", best.keep_attention},
                               {"next_length_limited_by", limit}}
                    .dump()
                    .c_str());
    return 0;
  }
  std::printf("longest sequence that fits: %lld tokens (%lld more do not: %s)\n",
              static_cast<long long>(lo), static_cast<long long>(step), limit.c_str());
  std::printf(
      "  plan %s; estimated peak device memory per worker %.2f GB of %.2f; shared memory %.2f GB "
      "of %.2f\n",
      best.choice.plan.Describe().c_str(), best.choice.peak_memory_bytes / 1e9,
      cfg.schedule.gpu_memory_gb, best.host_bytes / 1e9, host_limit / 1e9);
  if (best.mlp_tile_tokens > 0)
    std::printf("  MLP tile: %lld tokens\n", static_cast<long long>(best.mlp_tile_tokens));
  if (best.kept_blocks > 0)
    std::printf("  kept blocks: %lld\n", static_cast<long long>(best.kept_blocks));
  if (best.keep_attention > 0)
    std::printf("  blocks keeping their attention: %lld\n",
                static_cast<long long>(best.keep_attention));
  std::printf("  predicted step %.3f s, %.0f tokens/s (%s costs)\n", best.choice.step_seconds,
              tokens / best.choice.step_seconds, best.choice.cost_source.c_str());
  if (cfg.schedule.profile.empty() && cfg.job.device != rp::core::DeviceKind::kCpu)
    std::printf("  device assumed: %s (--device %s)\n", device.source.c_str(), device.name.c_str());
  return 0;
}

// The GPU the cost model assumes: a named one, or one of the given rates.
rp::StatusOr<rp::core::DeviceModel> DeviceFromFlags(const std::string& device_name, double tflops,
                                                    double h2d_gbs) {
  if (device_name != "custom") {
    if (tflops > 0 || h2d_gbs > 0)
      return rp::Status::InvalidArgument("--tflops and --h2d-gbs go with --device custom");
    return rp::core::DeviceModelNamed(device_name);
  }
  if (tflops <= 0 || h2d_gbs <= 0)
    return rp::Status::InvalidArgument("--device custom needs --tflops and --h2d-gbs");
  rp::core::DeviceModel device = rp::core::H200Model();  // fp32 and the optimizer scale with it
  device.name = "custom";
  device.fp32_flops_per_s = device.fp32_flops_per_s * tflops * 1e12 / device.bf16_flops_per_s;
  device.bf16_flops_per_s = tflops * 1e12;
  device.link_bytes_per_s = h2d_gbs * 1e9;
  device.memory_gb = 0.0;
  char text[160];
  std::snprintf(text, sizeof(text),
                "custom: bf16 products at %g TFLOP/s, host link %g GB/s, AdamW 6.7e9 "
                "parameters/s",
                tflops, h2d_gbs);
  device.source = text;
  return device;
}

nlohmann::json ChoiceJson(const rp::core::PlanChoice& c, double step_tokens) {
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& s : c.plan.stages)
    stages.push_back({{"kind", rp::core::StageKindName(s.kind)}, {"layers", {s.begin, s.end}}});
  return nlohmann::json{
      {"plan", c.plan.Describe()},
      {"stages", stages},
      {"predicted_step_s", c.step_seconds},
      {"predicted_tokens_per_s", step_tokens / c.step_seconds},
      {"predicted_bubble_ratio", c.bubble_ratio},
      {"predicted_first_step_s", c.first_step_seconds},
      {"first_step_fill_ratio", c.fill_ratio},
      {"first_step_drain_ratio", c.drain_ratio},
      {"first_step_imbalance_ratio", c.imbalance_ratio},
      {"peak_memory_bytes_per_worker", c.peak_memory_bytes},
      {"peak_memory_parts",
       {{"stage", c.memory.stage >= 0 ? c.plan.stages[c.memory.stage].Describe() : "-"},
        {"weights", c.memory.weights},
        {"next_job_weights", c.memory.next_weights},
        {"gradients", c.memory.gradients},
        {"activations", c.memory.activations},
        {"resident_activation_slots", c.memory.resident},
        {"staging", c.memory.staging},
        {"gradients_waiting_for_slots", c.held_grad_bytes},
        {"gradients_waiting_for_norm", c.memory.held_gradients},
        {"kept_graphs", c.memory.kept},
        {"kept_attention", c.memory.kept_attention},
        {"frozen_on_device", c.memory.frozen},
        {"device_update", c.memory.device_update},
        {"not_at_once", c.memory.not_at_once}}}};
}

void PrintChoice(const char* title, const rp::core::PlanChoice& c, double step_tokens, int nnodes) {
  std::printf("%s: %s\n", title, c.plan.Describe().c_str());
  std::printf("  predicted step (steady state): %.4f s, bubble ratio %.1f%%, %.0f tokens/s%s\n",
              c.step_seconds, 100.0 * c.bubble_ratio, step_tokens / c.step_seconds,
              nnodes > 1 ? (" over " + std::to_string(nnodes) + " nodes").c_str() : "");
  std::printf("  first step from idle: %.4f s; idle: fill %.1f%%, drain %.1f%%, imbalance %.1f%%\n",
              c.first_step_seconds, 100.0 * c.fill_ratio, 100.0 * c.drain_ratio,
              100.0 * c.imbalance_ratio);
  std::printf("  estimated peak memory per worker: %.2f GB\n", c.peak_memory_bytes / 1e9);
  const auto& m = c.memory;
  std::printf(
      "    during %s: weights %.2f, next job's weights %.2f, gradients %.2f, activations %.2f, "
      "gradients waiting for slots %.2f, for the norm or the previous update %.2f, resident "
      "activation slots %.2f, "
      "staging %.2f, "
      "kept blocks %.2f, kept attention %.2f, frozen base on the device %.2f, device update "
      "%.2f GB; of those never at once %.2f GB\n",
      m.stage >= 0 ? c.plan.stages[m.stage].Describe().c_str() : "-", m.weights / 1e9,
      m.next_weights / 1e9, m.gradients / 1e9, m.activations / 1e9, c.held_grad_bytes / 1e9,
      m.held_gradients / 1e9, m.resident / 1e9, m.staging / 1e9, m.kept / 1e9,
      m.kept_attention / 1e9, m.frozen / 1e9, m.device_update / 1e9, m.not_at_once / 1e9);
}

// rp-plan's command line.
struct PlanFlags {
  std::string job;
  std::vector<std::string> overrides;
  int gpus = 1;
  bool json = false;
  std::string profile;
  int nnodes = 1;
  bool max_seq = false;
  int64_t seq_step = 1024;
  double host_memory_gb = 0.0;
  std::string device_name = "h200";
  double tflops = 0.0, h2d_gbs = 0.0;
  double optimizer_gparams = 0.0;  // 0: the device model's AdamW rate
};

void AddFlags(CLI::App& app, PlanFlags* f) {
  app.add_option("job", f->job, "job file (TOML)")->required();
  app.add_option("--gpus", f->gpus, "workers")->check(CLI::Range(1, 4096));
  app.add_option("--set", f->overrides, "override a job key: section.key=value (repeatable)");
  app.add_option("--profile", f->profile,
                 "measured profile.json to plan with (else the FLOP cost model)");
  app.add_flag("--json", f->json, "print JSON only");
  app.add_option("--nnodes", f->nnodes,
                 "nodes the job runs on (rp-launch --nnodes): plan and predict one node's share, "
                 "with the cross-node gradient sums")
      ->check(CLI::Range(1, 65536));
  app.add_flag("--max-seq", f->max_seq,
               "print the longest data.seq_len that fits schedule.gpu_memory_gb per worker and the "
               "host's memory");
  app.add_option("--seq-step", f->seq_step, "--max-seq: lengths searched are multiples of this")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option(
         "--host-memory-gb", f->host_memory_gb,
         "--max-seq: shared memory the run may take (default: schedule.host_memory_gb, else "
         "this host's available memory)")
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--device", f->device_name,
                 "the GPU the cost model assumes: h200 (default), h100, or custom (with --tflops "
                 "and --h2d-gbs); "
                 "a measured --profile or schedule.profile replaces its rates");
  app.add_option("--tflops", f->tflops,
                 "--device custom: the dense bf16 TFLOP/s the GPU's matrix products reach")
      ->check(CLI::Range(0.001, 1e6));
  app.add_option("--h2d-gbs", f->h2d_gbs, "--device custom: host-to-device GB/s of its link")
      ->check(CLI::Range(0.001, 1e6));
  app.add_option("--optimizer-gparams", f->optimizer_gparams,
                 "this host's AdamW rate in 1e9 parameters per second, as rp-optim-bench's "
                 "adamw_params_per_s reports it (one pass writing a bf16 copy, 30 bytes per "
                 "parameter), for the cost model (default: the device model's)")
      ->check(CLI::Range(0.001, 1e6));
}

}  // namespace

int main(int argc, char** argv) {
  PlanFlags flags;
  CLI::App app{"Show the automatic pipeline plan for a job"};
  AddFlags(app, &flags);
  CLI11_PARSE(app, argc, argv);
  const int gpus = flags.gpus, nnodes = flags.nnodes;
  const bool json = flags.json;
  auto device = DeviceFromFlags(flags.device_name, flags.tflops, flags.h2d_gbs);
  if (!device.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", device.status().message().c_str());
    return rp::kExitBadConfig;
  }
  if (flags.optimizer_gparams > 0) {
    device->optimizer_params_per_s = flags.optimizer_gparams * 1e9;
    device->optimizer_pass_bytes = rp::core::kOptimBenchPassBytes;
    device->source += "; AdamW at " + std::to_string(flags.optimizer_gparams) +
                      "e9 parameters/s of 30-byte passes (--optimizer-gparams)";
  }
  auto cfg = rp::core::LoadJobConfig(flags.job, flags.overrides);
  if (!cfg.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", cfg.status().message().c_str());
    return rp::kExitBadConfig;
  }
  cfg->nodes.count = nnodes;
  if (auto s = rp::core::CheckNodes(*cfg); !s.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", s.message().c_str());
    return rp::kExitBadConfig;
  }
  // Every node runs the same share: the global tokens of a step over one node's step time.
  const double step_tokens =
      static_cast<double>(rp::core::GlobalRound(*cfg).calls *
                          rp::core::GlobalRound(*cfg).microbatches * cfg->TokensPerMicrobatch());
  if (!flags.profile.empty()) cfg->schedule.profile = flags.profile;
  if (flags.max_seq) return MaxSeq(*cfg, gpus, flags.seq_step, flags.host_memory_gb, json, *device);
  const bool tile_chosen = cfg->train.mlp_tile_tokens == rp::core::kMlpTileAuto;
  if (auto s = rp::core::ResolveMlpTile(&*cfg, gpus, rp::shm::SharedBytesFor(gpus)); !s.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", s.message().c_str());
    return rp::kExitBadConfig;
  }
  const bool attention_chosen = cfg->schedule.keep_attention == rp::core::kKeepAttentionAuto;
  if (auto s = rp::core::ResolveKeptAttention(&*cfg, gpus, rp::shm::SharedBytesFor(gpus));
      !s.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", s.message().c_str());
    return rp::kExitBadConfig;
  }
  const bool kept_chosen = cfg->schedule.kept_blocks == rp::core::kKeptBlocksAuto;
  if (auto s = rp::core::ResolveKeptBlocks(&*cfg, gpus); !s.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", s.message().c_str());
    return rp::kExitBadConfig;
  }
  auto costs = rp::core::PlanningProfile(*cfg, *device);
  if (!costs.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", costs.status().message().c_str());
    return rp::kExitBadConfig;
  }
  // No auto plan under schedule.gpu_memory_gb is an error only when the job asks for one; a job
  // with its own plan still runs that, so its prediction is shown with the reason.
  const bool auto_plan = rp::core::ResolveExecution(*cfg).planner_chooses_partition;
  const rp::core::SharedBytesOf shared_bytes = rp::shm::SharedBytesFor(gpus);
  auto choice = rp::core::ChoosePlan(*cfg, gpus, *costs, shared_bytes);
  if (!choice.ok() && auto_plan) {
    std::fprintf(stderr, "rp-plan: %s\n", choice.status().message().c_str());
    return rp::kExitBadConfig;
  }
  // The job's own plan under the same costs, when it is not "auto" (what the run would do).
  std::optional<rp::core::PlanChoice> own;
  if (!auto_plan) {
    auto plan = rp::core::BuildPlan(*cfg);
    if (!plan.ok()) {
      std::fprintf(stderr, "rp-plan: %s\n", plan.status().message().c_str());
      return rp::kExitBadConfig;
    }
    own = rp::core::PredictPlan(*cfg, *plan, *costs, gpus);
  }
  // The passes are chosen for the plan the run would use, found with auto counting as two (as
  // rp-launch resolves them); where one pass is chosen, the predictions are made again with it.
  auto passes = rp::core::ResolveUpdatePasses(&*cfg, gpus, *costs, own ? own->plan : choice->plan);
  if (!passes.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", passes.status().message().c_str());
    return rp::kExitBadConfig;
  }
  if (passes->chosen && passes->passes == 1) {
    if (own) own = rp::core::PredictPlan(*cfg, own->plan, *costs, gpus);
    if (choice.ok()) {
      const int candidates = choice->candidates;
      *choice = rp::core::PredictPlan(*cfg, choice->plan, *costs, gpus);
      choice->candidates = candidates;
    }
  }
  // What the job would run (its own plan, else the auto one) against keeping a LoRA base on the
  // GPU.
  const rp::core::PlanChoice& runs = own ? *own : *choice;
  const auto frozen_alt =
      rp::core::FrozenOnDeviceAlternative(*cfg, gpus, *costs, runs.step_seconds, shared_bytes);
  // Each plan's shared memory, as rp-launch would lay it out (-1 where it cannot be laid out).
  auto shared_of = [&](const rp::core::PlanChoice& c) {
    auto bytes = shared_bytes(*cfg, c.plan);
    return bytes.ok() ? static_cast<double>(*bytes) : -1.0;
  };
  auto to_json = [&](const rp::core::PlanChoice& c) {
    nlohmann::json j = ChoiceJson(c, step_tokens);
    j["shared_memory_bytes"] = shared_of(c);
    return j;
  };

  if (json) {
    nlohmann::json out = choice.ok()
                             ? to_json(*choice)
                             : nlohmann::json{{"auto_plan_error", choice.status().message()}};
    out["workers"] = gpus;
    out["nodes"] = nnodes;
    out["candidates"] = choice.ok() ? choice->candidates : 0;
    out["costs"] = runs.cost_source;
    out["device"] = device->name;
    out["device_model"] = device->source;
    out["mlp_tile_tokens"] = cfg->train.mlp_tile_tokens;
    out["mlp_tile_chosen"] = tile_chosen;
    out["kept_blocks"] = cfg->schedule.kept_blocks;
    out["kept_blocks_chosen"] = kept_chosen;
    out["keep_attention"] = cfg->schedule.keep_attention;
    out["keep_attention_chosen"] = attention_chosen;
    out["update_passes"] = passes->passes;
    out["update_passes_chosen"] = passes->chosen;
    if (passes->one_pass_step_s > 0)
      out["update_passes_step_s"] = {{"one", passes->one_pass_step_s},
                                     {"two", passes->two_pass_step_s}};
    if (own) out["job_plan"] = to_json(*own);
    if (frozen_alt) out["frozen_on_device_alternative"] = to_json(*frozen_alt);
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  auto print = [&](const char* title, const rp::core::PlanChoice& c) {
    PrintChoice(title, c, step_tokens, nnodes);
    if (const double bytes = shared_of(c); bytes >= 0) {
      std::printf("  shared memory: %.2f GB", bytes / 1e9);
      if (cfg->schedule.host_memory_gb > 0)
        std::printf(" of schedule.host_memory_gb = %.2f", cfg->schedule.host_memory_gb);
      std::printf("\n");
    }
  };

  std::printf("costs: %s%s%s\n", runs.cost_source.c_str(),
              cfg->schedule.profile.empty() ? "" : " from ", cfg->schedule.profile.c_str());
  if (cfg->schedule.profile.empty() && cfg->job.device != rp::core::DeviceKind::kCpu)
    std::printf("device assumed: %s (--device %s)\n", device->source.c_str(), device->name.c_str());
  if (tile_chosen)
    std::printf("MLP tile chosen for schedule.gpu_memory_gb = %.2f: %s\n",
                cfg->schedule.gpu_memory_gb,
                cfg->train.mlp_tile_tokens == 0
                    ? "untiled (the whole microbatch fits)"
                    : (std::to_string(cfg->train.mlp_tile_tokens) + " tokens").c_str());
  if (attention_chosen)
    std::printf("blocks keeping their attention chosen for schedule.gpu_memory_gb = %.2f: %lld\n",
                cfg->schedule.gpu_memory_gb, static_cast<long long>(cfg->schedule.keep_attention));
  if (kept_chosen)
    std::printf("kept blocks chosen for schedule.gpu_memory_gb = %.2f: %lld\n",
                cfg->schedule.gpu_memory_gb, static_cast<long long>(cfg->schedule.kept_blocks));
  if (passes->chosen && passes->one_pass_step_s > 0 &&
      passes->one_pass_step_s != passes->two_pass_step_s)
    std::printf(
        "update passes chosen: %lld (predicted %.3f s per step with one, %.3f s with two)\n",
        static_cast<long long>(passes->passes), passes->one_pass_step_s, passes->two_pass_step_s);
  else if (passes->chosen && passes->one_pass_step_s > 0)
    std::printf("update passes chosen: 2 (the same predicted step either way: %.3f s)\n",
                passes->two_pass_step_s);
  else if (passes->chosen)
    std::printf("update passes: 1 (two apply only in exact mode with every gradient held)\n");
  const std::string auto_title =
      "auto plan for " + std::to_string(gpus) + " workers" +
      (nnodes > 1 ? " on each of " + std::to_string(nnodes) + " nodes" : std::string());
  if (choice.ok()) print(auto_title.c_str(), *choice);
  else std::printf("%s: none (%s)\n", auto_title.c_str(), choice.status().message().c_str());
  if (own) print("the job's own plan", *own);
  if (frozen_alt)
    print(
        "with schedule.frozen_on_device = true (the frozen base kept on each GPU, only the "
        "adapters fetched)",
        *frozen_alt);
  if (choice.ok())
    std::printf("(%d candidate plans evaluated; use with [schedule] partition = \"auto\")\n",
                choice->candidates);
  return 0;
}
