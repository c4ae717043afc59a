// SPDX-License-Identifier: Apache-2.0
#include "planning/run_spec.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "config/mode_key_access.h"
#include "io/data.h"
#include "io/run_output.h"
#include "planning/partitioner.h"

namespace rp::core {

// A field added to one of these structs must be added to its list below too; the sizes make the
// compiler say so (x86-64, libstdc++).
static_assert(sizeof(RopeConfig) == 80);
static_assert(sizeof(MoeConfig) == 72);
static_assert(sizeof(ModelConfig) == 312);
static_assert(sizeof(DataConfig) == 104);
static_assert(sizeof(LossScaling) == 32);
static_assert(sizeof(TrainConfig) == 144);
static_assert(sizeof(OptimizerConfig) == 120);
static_assert(sizeof(LoraConfig) == 136);
static_assert(sizeof(ScheduleConfig) == 184);
static_assert(sizeof(CheckpointConfig) == 112);
static_assert(sizeof(BenchKnobs) == 24);
static_assert(sizeof(JobOptions) == 112);
static_assert(sizeof(NodesConfig) == 56);
static_assert(sizeof(PipelinePlan) == 88);
static_assert(sizeof(MetricsConfig) == 2);
static_assert(sizeof(ExecutionPlan) == 28);

namespace {
constexpr int kSpecVersion = 13;
// Earlier versions that rp-export still reads from a run's directory. Their jobs have no
// schedule.keep_attention (false: their attention was recomputed) and before version 12 no
// schedule.host_memory_gb (their plans ignored host memory: 0). Versions 9 and 10 have no
// optimizer.update_passes either: those builds updated in two passes wherever exact mode's arena
// held every slot, which 2 gives. Version 9 stored no execution plan (the job's resolution stands
// in); version 10's lacks the update passes (resolved from the job likewise).
constexpr int kSpecVersionWithoutExecution = 9;
constexpr int kSpecVersionWithoutUpdatePasses = 10;
constexpr int kSpecVersionWithoutHostMemory = 11;
constexpr int kSpecVersionWithoutKeptAttention = 12;
}  // namespace

// Enums travel by their job-file names; an unknown name is refused.
#define RP_SPEC_ENUM(E, NAME)                                  \
  void to_json(nlohmann::json& j, const E& e) { j = NAME(e); } \
  void from_json(const nlohmann::json& j, E& e) {              \
    const std::string s = j.get<std::string>();                \
    for (int v = 0; v < 16; ++v)                               \
      if (s == NAME(static_cast<E>(v))) {                      \
        e = static_cast<E>(v);                                 \
        return;                                                \
      }                                                        \
    throw std::invalid_argument("\"" + s + "\" is not a " #E); \
  }
RP_SPEC_ENUM(DeviceKind, EnumName)
RP_SPEC_ENUM(DataFormat, EnumName)
RP_SPEC_ENUM(DataPacking, EnumName)
RP_SPEC_ENUM(LongRecords, EnumName)
RP_SPEC_ENUM(TrainDtype, EnumName)
RP_SPEC_ENUM(OptimizerName, EnumName)
RP_SPEC_ENUM(OptimizerMode, EnumName)
RP_SPEC_ENUM(OptimizerState, EnumName)
RP_SPEC_ENUM(LrSchedule, EnumName)
RP_SPEC_ENUM(ExportDtype, EnumName)
RP_SPEC_ENUM(Activations, EnumName)
RP_SPEC_ENUM(WeightsSource, EnumName)
RP_SPEC_ENUM(EmbeddingLookup, EnumName)
RP_SPEC_ENUM(Partition, EnumName)
RP_SPEC_ENUM(GradientsWait, EnumName)
RP_SPEC_ENUM(Tristate, EnumName)
RP_SPEC_ENUM(StageKind, StageKindName)
RP_SPEC_ENUM(RopeConfig::Type, RopeTypeName)
#undef RP_SPEC_ENUM
// Mode keys travel as their values: the spec records the job file's keys as they are.
template <typename T>
void to_json(nlohmann::json& j, const ModeKey<T>& k) {
  j = k.Read(ModeKeyGrant::Access());
}
template <typename T>
void from_json(const nlohmann::json& j, ModeKey<T>& k) {
  j.get_to(k.Field(ModeKeyGrant::Access()));
}
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(RopeConfig, type, theta, factor, low_freq_factor,
                                   high_freq_factor, original_max_position, attention_factor,
                                   beta_fast, beta_slow, truncate)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MoeConfig, num_experts, experts_per_token,
                                   expert_intermediate_size, norm_topk_prob, sparse_step,
                                   dense_layers, aux_loss_weight)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ModelConfig, path, model_type, vocab_size, hidden_size,
                                   intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
                                   rope, rms_norm_eps, qk_norm, qkv_bias, o_bias, mlp_bias,
                                   tie_embeddings, sliding_window, max_position_embeddings,
                                   init_std, moe)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(DataConfig, format, path, seq_len, shuffle, eval_path,
                                   eval_fraction, packing, long_records)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(LossScaling, init, growth_factor, backoff_factor,
                                   growth_interval)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(TrainConfig, steps, epochs, seed, microbatches, accum_calls,
                                   microbatch_size, dtype, loss_scaling, grad_clip,
                                   loss_chunk_tokens, mlp_tile_tokens, layer_recompute, stop_after,
                                   eval_every, eval_microbatches)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(OptimizerConfig, name, mode, state, gradients_wait_in, lr,
                                   min_lr, lr_schedule, warmup_steps, warmup_ratio, weight_decay,
                                   beta1, beta2, eps, momentum, grad_buffer_mb, speculative_update,
                                   device_update_blocks, update_passes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(LoraConfig, rank, alpha, dropout, target_modules,
                                   target_parameters, init_from, export_dir)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ScheduleConfig, forward_stages, backward_stages, tail_blocks,
                                   kept_blocks, keep_attention, frozen_on_device, activations,
                                   weights_source, embedding_lookup, forward_cuts, backward_cuts,
                                   partition, gpu_memory_gb, host_memory_gb, profile, profile_steps,
                                   replan_gain, drift, node_link_gb_s)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CheckpointConfig, every, dir, keep, memory_gb, export_hf,
                                   export_shard_mb, export_dtype, export_every)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MetricsConfig, trace, tensorboard)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(BenchKnobs, interleave_calls, merge_calls, layer_major_forward,
                                   fused_kernels, fused_norms, grouped_experts, optimizer_threads,
                                   optimizer_rest_threads)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(JobOptions, name, output_dir, device, max_worker_restarts,
                                   worker_timeout_s, stopped_timeout_s, device_memory_limit_gib,
                                   node_timeout_s)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(NodesConfig, count, rank, store_host, store_port)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(JobConfig, job, model, data, train, optimizer, lora, schedule,
                                   checkpoint, metrics, bench, nodes, source_path)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ExecutionPlan, weight_version_lag, updates_wait_for_norm,
                                   gradients_wait_in_workers, speculative_update,
                                   device_update_blocks, two_pass_updates,
                                   planner_chooses_update_passes, workers_fetch_masters,
                                   lookup_from_host, sharded_state, sharded_gradients,
                                   frozen_on_device, activations, activation_parities,
                                   interleave_calls, planner_chooses_partition)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Stage, kind, begin, end)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PipelinePlan, num_layers, tail_start, kept_start, stages,
                                   hidden_boundaries, grad_boundaries)

StatusOr<RunSpec> ResolveRun(const std::string& job_path, const std::vector<std::string>& overrides,
                             int workers, const NodesConfig& nodes, const HostFacts& host,
                             const SessionInputs& session) {
  RunSpec spec;
  RP_ASSIGN_OR_RETURN(spec.job, LoadJobConfig(job_path, overrides, host));
  if (!session.frozen_profile.empty()) spec.job.schedule.profile = session.frozen_profile;
  if (session.replanning_off) spec.job.schedule.replan_gain = 0.0;
  spec.job.nodes = nodes;
  RP_RETURN_IF_ERROR(CheckNodes(spec.job));
  RP_RETURN_IF_ERROR(ResolveTrainingLength(&spec.job));
  if (nodes.count > 1) {
    spec.job.job.max_worker_restarts = 0;
    if (nodes.rank > 0) {
      auto& out = spec.job.job.output_dir;
      spec.job.checkpoint.dir =
          (std::filesystem::path(out) / spec.job.checkpoint.dir).lexically_normal().string();
      out = (std::filesystem::path(out) / ("node-" + std::to_string(nodes.rank))).string();
    }
  }
  RP_RETURN_IF_ERROR(ResolveMlpTile(&spec.job, workers, session.shared_bytes));
  RP_RETURN_IF_ERROR(ResolveKeptAttention(&spec.job, workers, session.shared_bytes));
  RP_RETURN_IF_ERROR(ResolveKeptBlocks(&spec.job, workers));
  RP_ASSIGN_OR_RETURN(spec.plan, MakePlan(spec.job, workers, session.shared_bytes));
  {
    // The passes change no bit and no byte of memory: a profile that cannot be read here (the
    // planner reports it where it matters) leaves the choice to the cost model.
    auto costs = PlanningProfile(spec.job);
    RP_RETURN_IF_ERROR(ResolveUpdatePasses(&spec.job, workers,
                                           costs.ok() ? *costs : DefaultCostModel(spec.job),
                                           spec.plan)
                           .status());
  }
  spec.execution = ResolveExecution(spec.job);
  if (spec.execution.device_update_blocks > 0 && workers != 1)
    return Status::InvalidArgument(
        "optimizer.device_update_blocks: needs one worker (--gpus 1): the worker that "
        "holds a step's gradients must also run the next step's first stages, and with " +
        std::to_string(workers) + " workers they take turns");
  spec.workers = workers;
  return spec;
}

std::string SharedOutputDir(const JobConfig& job) {
  if (job.nodes.count > 1 && job.nodes.rank > 0)
    return std::filesystem::path(job.job.output_dir).parent_path().string();
  return job.job.output_dir;
}

std::string RunSpecJson(const RunSpec& spec) {
  const nlohmann::json j = {{"version", kSpecVersion},
                            {"workers", spec.workers},
                            {"job", spec.job},
                            {"execution", spec.execution},
                            {"plan", spec.plan}};
  return j.dump(1) + "\n";
}

StatusOr<RunSpec> ParseRunSpec(const std::string& text, const std::string& what) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return Status::InvalidArgument(what + ": not a JSON object");
  const bool without_execution =
      j.contains("version") && j["version"] == kSpecVersionWithoutExecution;
  const bool without_update_passes =
      without_execution ||
      (j.contains("version") && j["version"] == kSpecVersionWithoutUpdatePasses);
  const bool without_host_memory =
      without_update_passes ||
      (j.contains("version") && j["version"] == kSpecVersionWithoutHostMemory);
  const bool without_kept_attention =
      without_host_memory ||
      (j.contains("version") && j["version"] == kSpecVersionWithoutKeptAttention);
  if (!j.contains("version") || (j["version"] != kSpecVersion && !without_kept_attention))
    return Status::InvalidArgument(
        what + ": run spec version " + (j.contains("version") ? j["version"].dump() : "none") +
        ", this build reads " + std::to_string(kSpecVersion) +
        " (rp-launch and the other programs come from different builds?)");
  RunSpec spec;
  try {
    spec.workers = j.at("workers").get<int>();
    if (without_update_passes) j.at("job").at("optimizer")["update_passes"] = 2;
    if (without_host_memory) j.at("job").at("schedule")["host_memory_gb"] = 0.0;
    if (without_kept_attention) j.at("job").at("schedule")["keep_attention"] = 0;
    spec.job = j.at("job").get<JobConfig>();
    if (without_update_passes && !without_execution) {
      const ExecutionPlan resolved = ResolveExecution(spec.job);
      j.at("execution")["two_pass_updates"] = resolved.two_pass_updates;
      j.at("execution")["planner_chooses_update_passes"] = resolved.planner_chooses_update_passes;
    }
    spec.execution =
        without_execution ? ResolveExecution(spec.job) : j.at("execution").get<ExecutionPlan>();
    spec.plan = j.at("plan").get<PipelinePlan>();
  } catch (const std::exception& e) {
    return Status::InvalidArgument(what + ": not a complete run spec: " + e.what());
  }
  // Every process acts on the stored decisions; they must be the ones its job resolves to (a
  // spec edited by hand, or written by another build's resolution, is refused).
  if (const ExecutionPlan resolved = ResolveExecution(spec.job); spec.execution != resolved)
    return Status::InvalidArgument(
        what + ": execution " + nlohmann::json(spec.execution).dump() +
        " is not what its job resolves to, " + nlohmann::json(resolved).dump() +
        " (rp-launch and the other programs come from different builds?)");
  if (spec.workers < 1) return Status::InvalidArgument(what + ": workers must be at least 1");
  return spec;
}

Status WriteRunSpec(const std::string& path, const RunSpec& spec) {
  return WriteFileAtomically(path, RunSpecJson(spec));
}

StatusOr<RunSpec> ReadRunSpec(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::InvalidArgument("run spec: cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseRunSpec(ss.str(), "run spec " + path);
}

StatusOr<RunSpec> ReadRunSpecFor(const std::string& path, int workers) {
  RP_ASSIGN_OR_RETURN(RunSpec spec, ReadRunSpec(path));
  if (spec.workers != workers)
    return Status::InvalidArgument("run spec " + path + " was resolved for " +
                                   std::to_string(spec.workers) + " workers, this run has " +
                                   std::to_string(workers));
  return spec;
}

}  // namespace rp::core
