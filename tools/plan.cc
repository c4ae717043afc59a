// SPDX-License-Identifier: Apache-2.0
// rp-plan job.toml --gpus N [--nnodes N] [--profile out/profile.json] [--set section.key=value ...] [--json]
// Prints the plan schedule.partition = "auto" would run, with the simulator's predictions from
// a measured profile (--profile, or schedule.profile) or the FLOP cost model. With
// partition = "equal" in the job it also shows the job's own plan under the same costs.
// --json prints one JSON object and nothing else.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>

#include <nlohmann/json.hpp>

#include "common/exit_codes.h"
#include "config/job_config.h"
#include "planning/partitioner.h"
#include "planning/plan.h"

int main(int argc, char** argv) {
  std::string job;
  std::vector<std::string> overrides;
  int gpus = 1;
  bool json = false;
  CLI::App app{"Show the automatic pipeline plan for a job"};
  app.add_option("job", job, "job file (TOML)")->required();
  app.add_option("--gpus", gpus, "workers")->check(CLI::Range(1, 4096));
  app.add_option("--set", overrides, "override a job key: section.key=value (repeatable)");
  std::string profile;
  app.add_option("--profile", profile, "measured profile.json to plan with (else the FLOP cost model)");
  app.add_flag("--json", json, "print JSON only");
  int nnodes = 1;
  app.add_option("--nnodes", nnodes, "nodes the job runs on (rp-launch --nnodes): plan and predict one node's share, "
                                     "with the cross-node gradient sums")
      ->check(CLI::Range(1, 65536));
  CLI11_PARSE(app, argc, argv);
  auto cfg = rp::core::LoadJobConfig(job, overrides);
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
  const double step_tokens = static_cast<double>(rp::core::GlobalRound(*cfg).calls * rp::core::GlobalRound(*cfg).microbatches *
                                                 cfg->TokensPerMicrobatch());
  if (!profile.empty()) cfg->schedule.profile = profile;
  auto costs = rp::core::PlanningProfile(*cfg);
  if (!costs.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", costs.status().message().c_str());
    return rp::kExitBadConfig;
  }
  auto choice = rp::core::ChoosePlan(*cfg, gpus, *costs);
  if (!choice.ok()) {
    std::fprintf(stderr, "rp-plan: %s\n", choice.status().message().c_str());
    return rp::kExitBadConfig;
  }
  // The job's own plan under the same costs, when it is not "auto" (what the run would do).
  std::optional<rp::core::PlanChoice> own;
  if (cfg->schedule.partition != rp::core::Partition::kAuto) {
    auto plan = rp::core::BuildPlan(*cfg);
    if (!plan.ok()) {
      std::fprintf(stderr, "rp-plan: %s\n", plan.status().message().c_str());
      return rp::kExitBadConfig;
    }
    own = rp::core::PredictPlan(*cfg, *plan, *costs, gpus);
  }
  auto to_json = [&](const rp::core::PlanChoice& c) {
    nlohmann::json stages = nlohmann::json::array();
    for (const auto& s : c.plan.stages)
      stages.push_back({{"kind", rp::core::StageKindName(s.kind)}, {"layers", {s.begin, s.end}}});
    return nlohmann::json{{"plan", c.plan.Describe()}, {"stages", stages},
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
                            {"gradients_waiting_for_slots", c.held_grad_bytes}}}};
  };
  if (json) {
    nlohmann::json out = to_json(*choice);
    out["workers"] = gpus;
    out["nodes"] = nnodes;
    out["candidates"] = choice->candidates;
    out["costs"] = choice->cost_source;
    if (own) out["job_plan"] = to_json(*own);
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  auto print = [&](const char* title, const rp::core::PlanChoice& c) {
    std::printf("%s: %s\n", title, c.plan.Describe().c_str());
    std::printf("  predicted step (steady state): %.4f s, bubble ratio %.1f%%, %.0f tokens/s%s\n", c.step_seconds,
                100.0 * c.bubble_ratio, step_tokens / c.step_seconds,
                nnodes > 1 ? (" over " + std::to_string(nnodes) + " nodes").c_str() : "");
    std::printf("  first step from idle: %.4f s; idle: fill %.1f%%, drain %.1f%%, imbalance %.1f%%\n",
                c.first_step_seconds, 100.0 * c.fill_ratio, 100.0 * c.drain_ratio,
                100.0 * c.imbalance_ratio);
    std::printf("  estimated peak memory per worker: %.2f GB\n", c.peak_memory_bytes / 1e9);
    const auto& m = c.memory;
    std::printf("    during %s: weights %.2f, next job's weights %.2f, gradients %.2f, activations %.2f, "
                "gradients waiting for slots %.2f, resident activation slots %.2f, staging %.2f GB\n",
                m.stage >= 0 ? c.plan.stages[m.stage].Describe().c_str() : "-", m.weights / 1e9, m.next_weights / 1e9,
                m.gradients / 1e9, m.activations / 1e9, c.held_grad_bytes / 1e9, m.resident / 1e9,
                m.staging / 1e9);
  };
  std::printf("costs: %s%s%s\n", choice->cost_source.c_str(),
              cfg->schedule.profile.empty() ? "" : " from ", cfg->schedule.profile.c_str());
  print(("auto plan for " + std::to_string(gpus) + " workers" +
         (nnodes > 1 ? " on each of " + std::to_string(nnodes) + " nodes" : std::string()))
            .c_str(),
        *choice);
  if (own) print("the job's own plan", *own);
  std::printf("(%d candidate plans evaluated; use with [schedule] partition = \"auto\")\n",
              choice->candidates);
  return 0;
}
