// SPDX-License-Identifier: Apache-2.0
#include "config/cross_checks.h"
#include "config/execution_plan.h"
#include "config/mode_key_access.h"

#include <algorithm>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace rp::core {
namespace {

namespace fs = std::filesystem;

Status CheckDeviceMemoryLimit(const JobConfig& c) {
  if (c.job.device_memory_limit_gib > 0 && c.job.device == DeviceKind::kCpu)
    return Status::InvalidArgument(
        "job.device_memory_limit_gib: caps a CUDA worker's device memory, and "
        "job.device = \"cpu\" has none; leave it 0 or use CUDA workers");
  return Status::Ok();
}

Status CheckExperts(const JobConfig& c) {
  const auto& m = c.model;
  if (m.moe.num_experts > 0 && m.path.empty()) {
    if (m.moe.experts_per_token > m.moe.num_experts)
      return Status::InvalidArgument(
          "model.experts_per_token: " + std::to_string(m.moe.experts_per_token) +
          " is more than the " + std::to_string(m.moe.num_experts) + " experts");
    if (!m.qk_norm)
      return Status::InvalidArgument(
          "model.num_experts: experts are Qwen3-MoE's, whose attention has a q/k "
          "norm; set model.qk_norm = true");
  }
  if (m.moe.num_experts == 0 && m.moe.aux_loss_weight > 0.0)
    return Status::InvalidArgument(
        "model.router_aux_loss_coef: the model has no routers (model.num_experts = 0)");
  return Status::Ok();
}

Status CheckAttentionShape(const JobConfig& c) {
  const auto& m = c.model;
  if (m.num_heads % m.num_kv_heads != 0)
    return Status::InvalidArgument("model.num_kv_heads: must divide model.num_heads (" +
                                   std::to_string(m.num_heads) + "), got " +
                                   std::to_string(m.num_kv_heads));
  if (m.head_dim % 2 != 0)
    return Status::InvalidArgument("model.head_dim: must be even for rotary embeddings, got " +
                                   std::to_string(m.head_dim));
  if (m.sliding_window > 0 && c.data.seq_len > m.sliding_window)
    return Status::InvalidArgument(
        "data.seq_len: " + std::to_string(c.data.seq_len) + " is longer than the model's " +
        "sliding attention window (" + std::to_string(m.sliding_window) + " tokens, " + m.path +
        "/config.json: sliding_window), which is not implemented; sequences "
        "up to the window are exact");
  return Status::Ok();
}

Status CheckDataFiles(const JobConfig& c) {
  if (c.data.format == DataFormat::kTokens || c.data.format == DataFormat::kJsonl) {
    std::error_code ec;
    if (c.data.path.empty() || !fs::is_regular_file(c.data.path, ec))
      return Status::InvalidArgument("data.path: no such file: \"" + c.data.path +
                                     "\" (data.format = \"" + EnumName(c.data.format) + "\")");
  }
  if (c.data.format == DataFormat::kBytes) {
    if (c.data.path.empty())
      return Status::InvalidArgument("data.path: required when data.format = \"bytes\"");
    std::error_code ec;
    if (!fs::is_regular_file(c.data.path, ec))
      return Status::InvalidArgument("data.path: no such file: " + c.data.path);
    if (c.model.vocab_size < 256)
      return Status::InvalidArgument(
          "model.vocab_size: must be >= 256 for data.format = \"bytes\", got " +
          std::to_string(c.model.vocab_size));
    auto size = fs::file_size(c.data.path, ec);
    if (ec || static_cast<int64_t>(size) < c.data.seq_len + 1)
      return Status::InvalidArgument(
          "data.path: " + c.data.path +
          " holds fewer than seq_len + 1 = " + std::to_string(c.data.seq_len + 1) + " bytes");
  }
  return Status::Ok();
}

Status CheckPacking(const JobConfig& c) {
  if (c.data.packing != DataPacking::kStream && c.data.format != DataFormat::kJsonl &&
      !(c.data.format == DataFormat::kTokens && TokenFileHasDocuments(c.data.path)))
    return Status::InvalidArgument(
        std::string("data.packing: \"") + EnumName(c.data.packing) +
        "\" needs records; data.format = \"" + EnumName(c.data.format) +
        "\" is one stream without document boundaries "
        "(use data.format = \"jsonl\", a token file with a document index as "
        "tools/prepare_data.py writes it, or data.packing = \"stream\")");
  return Status::Ok();
}

Status CheckEvalSet(const JobConfig& c) {
  if (!c.data.eval_path.empty() && c.data.eval_fraction > 0.0)
    return Status::InvalidArgument(
        "data.eval_fraction: set together with data.eval_path; choose one");
  if (c.data.eval_fraction > 0.0 && c.data.format == DataFormat::kRandom)
    return Status::InvalidArgument(
        "data.eval_fraction: data.format = \"random\" evaluates on its own "
        "held-out synthetic stream; remove data.eval_fraction");
  if (!c.data.eval_path.empty()) {
    std::error_code ec;
    if (!fs::is_regular_file(c.data.eval_path, ec))
      return Status::InvalidArgument("data.eval_path: no such file: " + c.data.eval_path);
    if (c.data.format == DataFormat::kRandom)
      return Status::InvalidArgument(
          "data.eval_path: data.format = \"random\" evaluates on its own "
          "held-out synthetic stream; remove data.eval_path");
  }
  if (c.train.eval_every > 0 && c.data.format != DataFormat::kRandom && c.data.eval_path.empty() &&
      c.data.eval_fraction <= 0.0)
    return Status::InvalidArgument(
        "train.eval_every: needs an eval set: set data.eval_path or data.eval_fraction");
  return Status::Ok();
}

// Adapters on whole expert tensors (lora.target_parameters), and that an adapter has a target.
Status CheckLoraExpertTensors(const JobConfig& c) {
  if (!c.lora.enabled()) return Status::Ok();
  const auto& m = c.model;
  if (c.lora.target_modules.empty() && c.lora.target_parameters.empty())
    return Status::InvalidArgument(
        "lora.target_modules: empty; name at least one of q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj (or expert tensors in lora.target_parameters)");
  std::vector<std::string> seen;
  bool sparse = false;
  for (int64_t b = 0; b < m.num_layers; ++b) sparse = sparse || SparseBlock(m, b);
  for (const auto& name : c.lora.target_parameters) {
    const std::string t = CanonicalLoraParameter(name);
    if (t.empty())
      return Status::InvalidArgument(
          "lora.target_parameters: \"" + name +
          "\" is not a tensor this runtime adapts (mlp.experts.gate_up_proj, "
          "mlp.experts.down_proj, or a suffix of them after a dot, as PEFT matches)");
    if (std::find(seen.begin(), seen.end(), t) != seen.end())
      return Status::InvalidArgument("lora.target_parameters: \"" + name + "\" names " + t +
                                     " twice");
    seen.push_back(t);
    if (m.moe.num_experts == 0)
      return Status::InvalidArgument(
          "lora.target_parameters: \"" + name +
          "\" names expert tensors, and this model has no experts; use lora.target_modules");
    if (!sparse)
      return Status::InvalidArgument(
          "lora.target_parameters: \"" + name +
          "\" names expert tensors, and no block of this model is sparse (mlp_only_layers / "
          "sparse_step)");
    // PEFT adapts a whole tensor by adding B A to the weight before the product, so it cannot
    // drop out the adapter's input alone (and refuses dropout there); the same math here.
    if (c.lora.dropout > 0.0)
      return Status::InvalidArgument(
          "lora.dropout: must be 0 with lora.target_parameters (an adapter on "
          "expert tensors has no input of its own to drop, as in PEFT)");
    const bool gate_up = t == "mlp.experts.gate_up_proj";
    const int64_t in = gate_up ? m.hidden_size : m.moe.expert_intermediate_size;
    const int64_t out = gate_up ? 2 * m.moe.expert_intermediate_size : m.hidden_size;
    if (c.lora.rank > std::min(in, out))
      return Status::InvalidArgument("lora.rank: " + std::to_string(c.lora.rank) + " exceeds " + t +
                                     "'s " + std::to_string(out) + " x " + std::to_string(in) +
                                     " per-expert rank bound " + std::to_string(std::min(in, out)));
  }
  return Status::Ok();
}

Status CheckLoraModules(const JobConfig& c) {
  if (!c.lora.enabled()) return Status::Ok();
  const auto& m = c.model;
  std::vector<std::string> seen;
  for (const auto& t : c.lora.target_modules) {
    const auto& ok = LoraTargetableModules();
    if (std::find(ok.begin(), ok.end(), t) == ok.end())
      return Status::InvalidArgument("lora.target_modules: \"" + t +
                                     "\" is not a projection this runtime adapts (q_proj, "
                                     "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
    if (std::find(seen.begin(), seen.end(), t) != seen.end())
      return Status::InvalidArgument("lora.target_modules: \"" + t + "\" is listed twice");
    seen.push_back(t);
    // On a mixture-of-experts model these names mean different adapters to PEFT depending on
    // the transformers version (each expert a module of its own in 4, fused expert tensors
    // that module names do not reach in 5): refused, the experts take target_parameters.
    if (m.moe.num_experts > 0 && (t == "gate_proj" || t == "up_proj" || t == "down_proj"))
      return Status::InvalidArgument(
          "lora.target_modules: \"" + t +
          "\" on a mixture-of-experts model: the experts are adapted through "
          "lora.target_parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj), as PEFT "
          "names them");
    // B A has rank at most min(in, out): a larger rank adds parameters and no expressiveness.
    const int64_t q = m.num_heads * m.head_dim, kv = m.num_kv_heads * m.head_dim;
    const int64_t in = t == "o_proj" ? q : t == "down_proj" ? m.intermediate_size : m.hidden_size;
    const int64_t out = t == "q_proj"                          ? q
                        : (t == "k_proj" || t == "v_proj")     ? kv
                        : (t == "gate_proj" || t == "up_proj") ? m.intermediate_size
                                                               : m.hidden_size;
    if (c.lora.rank > std::min(in, out))
      return Status::InvalidArgument("lora.rank: " + std::to_string(c.lora.rank) + " exceeds " + t +
                                     "'s " + std::to_string(out) + " x " + std::to_string(in) +
                                     " weight's rank bound " + std::to_string(std::min(in, out)) +
                                     "; lower lora.rank or leave " + t +
                                     " out of lora.target_modules");
  }
  return Status::Ok();
}

// Adapter keys that need adapters, and an adapter to start from that exists.
Status CheckLoraStart(const JobConfig& c) {
  if (c.lora.enabled()) {
    std::error_code ec;
    if (!c.lora.init_from.empty() && !fs::is_directory(c.lora.init_from, ec))
      return Status::InvalidArgument("lora.init_from: no such directory: " + c.lora.init_from);
  } else if (!c.lora.init_from.empty()) {
    return Status::InvalidArgument(
        "lora.init_from: set, but lora.rank = 0 (full fine-tuning); "
        "set lora.rank to the adapter's rank");
  } else if (!c.lora.target_parameters.empty()) {
    return Status::InvalidArgument(
        "lora.target_parameters: set, but lora.rank = 0 (full fine-tuning); "
        "set lora.rank to train adapters");
  }
  if (c.schedule.frozen_on_device.Read(ModeKeyGrant::Access()) && !c.lora.enabled())
    return Status::InvalidArgument(
        "schedule.frozen_on_device: set, but lora.rank = 0: a full fine-tune has no "
        "frozen weights to keep on the device");
  return Status::Ok();
}

// The planner's choices that fit a plan into a device memory budget need that budget.
Status CheckBudgetedChoices(const JobConfig& c) {
  if (c.schedule.kept_blocks == kKeptBlocksAuto && !(c.schedule.gpu_memory_gb > 0.0))
    return Status::InvalidArgument(
        "schedule.kept_blocks = -1 (as many as fit) needs schedule.gpu_memory_gb, "
        "the device memory per worker the kept graphs must fit in");
  if (c.schedule.keep_attention == kKeepAttentionAuto && !(c.schedule.gpu_memory_gb > 0.0))
    return Status::InvalidArgument(
        "schedule.keep_attention = -1 (as many blocks as fit) needs schedule.gpu_memory_gb, "
        "the device memory per worker the attention records must fit in");
  if (c.train.mlp_tile_tokens == kMlpTileAuto && !(c.schedule.gpu_memory_gb > 0.0))
    return Status::InvalidArgument(
        "train.mlp_tile_tokens = -1 (chosen by the planner) needs schedule.gpu_memory_gb, "
        "the device memory per worker the plan must fit");
  return Status::Ok();
}

Status CheckLearningRate(const JobConfig& c) {
  if (c.optimizer.min_lr > c.optimizer.lr)
    return Status::InvalidArgument("optimizer.min_lr: must not exceed optimizer.lr");
  return Status::Ok();
}

Status CheckLossScaling(const JobConfig& c) {
  const LossScaling& ls = c.train.loss_scaling;
  if (!(ls.growth_factor > 1.0))
    return Status::InvalidArgument(
        "train.loss_scale_growth_factor: must be > 1 (a scale that never grows "
        "stays as low as its last overflow left it)");
  if (!(ls.backoff_factor < 1.0))
    return Status::InvalidArgument(
        "train.loss_scale_backoff_factor: must be < 1 (the scale must fall after an overflow)");
  const LossScaling defaults;
  if (!ScalesLoss(c) && (ls.init != defaults.init || ls.growth_factor != defaults.growth_factor ||
                         ls.backoff_factor != defaults.backoff_factor ||
                         ls.growth_interval != defaults.growth_interval))
    return Status::InvalidArgument(std::string("train.loss_scale_*: set, but train.dtype = \"") +
                                   EnumName(c.train.dtype) +
                                   "\" does not scale its loss; only \"fp16\" does");
  return Status::Ok();
}

Status CheckGradientsWaitInWorkers(const JobConfig& c) {
  const ExecutionPlan x = ResolveExecution(c);
  if (!x.gradients_wait_in_workers) return Status::Ok();
  const std::string key = "optimizer.gradients_wait_in: \"workers\" ";
  if (!x.updates_wait_for_norm)
    return Status::InvalidArgument(key +
                                   "holds gradients for the clipping norm, but train.grad_clip = "
                                   "0 streams them without one; use \"host\"");
  if (Round(c).calls > 1)
    return Status::InvalidArgument(
        key +
        "needs one accumulation round per step (train.accum_calls = 1, or exact mode, which "
        "merges the calls): with several, each round adds into the host's slots and no worker "
        "holds a whole gradient");
  if (c.model.tie_embeddings && !c.lora.enabled())
    return Status::InvalidArgument(
        key +
        "needs every trainable parameter in one layer: the tied embedding's gradient is the "
        "lookup's plus the head's, summed on the host (model.tie_embeddings = true); use "
        "\"host\"");
  return Status::Ok();
}

Status CheckSpeculativeUpdate(const JobConfig& c) {
  const ExecutionPlan x = ResolveExecution(c);
  if (!x.speculative_update) return Status::Ok();
  const std::string key = "optimizer.speculative_update: ";
  if (!x.NextStepWaitsForUpdate())
    return Status::InvalidArgument(
        key + "speculates past exact mode's wait for the norm; stale1 does not wait");
  if (c.optimizer.name != OptimizerName::kAdamW)
    return Status::InvalidArgument(key + "needs optimizer.name = \"adamw\"");
  if (!(c.train.grad_clip > 0.0))
    return Status::InvalidArgument(key +
                                   "guesses that a step is not clipped, but train.grad_clip = 0 "
                                   "never clips: updates then start as gradients land without it");
  if (x.gradients_wait_in_workers)
    return Status::InvalidArgument(
        key +
        "needs the gradients on the host before the norm (optimizer.gradients_wait_in = "
        "\"host\")");
  if (ScalesLoss(c))
    return Status::InvalidArgument(
        key + "is not implemented with fp16's loss scaling (train.dtype = \"fp16\")");
  return Status::Ok();
}

Status CheckUpdatePasses(const JobConfig& c) {
  const int64_t passes = c.optimizer.update_passes.Read(ModeKeyGrant::Access());
  const ExecutionPlan x = ResolveExecution(c);
  if (passes == 2 && !x.NextStepWaitsForUpdate())
    return Status::InvalidArgument(
        "optimizer.update_passes = 2: stale1 updates in one pass (nothing waits for a first "
        "one); set 1 or 0");
  if (passes == 1 && (x.speculative_update || x.device_update_blocks > 0))
    return Status::InvalidArgument(
        std::string("optimizer.update_passes = 1: ") +
        (x.speculative_update ? "optimizer.speculative_update" : "optimizer.device_update_blocks") +
        " is built on the first of two passes; set 2 or 0");
  return Status::Ok();
}

Status CheckDeviceUpdates(const JobConfig& c) {
  const ExecutionPlan x = ResolveExecution(c);
  if (x.device_update_blocks == 0) return Status::Ok();
  const std::string key = "optimizer.device_update_blocks: ";
  if (!x.NextStepWaitsForUpdate())
    return Status::InvalidArgument(key +
                                   "updates the blocks the next step needs first, which only "
                                   "exact mode waits for; stale1 does not wait");
  if (c.optimizer.name != OptimizerName::kAdamW)
    return Status::InvalidArgument(key + "needs optimizer.name = \"adamw\"");
  if (!(c.train.grad_clip > 0.0))
    return Status::InvalidArgument(key +
                                   "needs train.grad_clip > 0: without clipping each parameter "
                                   "is updated as its gradient lands, and no step boundary "
                                   "waits for the first blocks");
  if (x.speculative_update)
    return Status::InvalidArgument(key +
                                   "and optimizer.speculative_update both change where the "
                                   "next weights come from; use one");
  if (Round(c).calls > 1)
    return Status::InvalidArgument(key +
                                   "needs one accumulation round per step (train.accum_calls = "
                                   "1): with several, no worker holds a whole gradient");
  if (c.lora.enabled())
    return Status::InvalidArgument(key + "is not implemented for LoRA adapters");
  if (c.train.dtype == TrainDtype::kFp16 || c.train.dtype == TrainDtype::kFp8)
    return Status::InvalidArgument(key +
                                   "is implemented for train.dtype = \"bf16\" and \"fp32\", "
                                   "not \"" +
                                   EnumName(c.train.dtype) + "\"");
  if (x.device_update_blocks > c.model.num_layers)
    return Status::InvalidArgument(key + std::to_string(x.device_update_blocks) +
                                   " is more than the model's " +
                                   std::to_string(c.model.num_layers) + " blocks");
  return Status::Ok();
}

Status CheckFp8(const JobConfig& c) {
  if (c.train.dtype == TrainDtype::kFp8 && c.job.device == DeviceKind::kCpu)
    return Status::InvalidArgument(
        "train.dtype: \"fp8\" needs job.device = \"cuda\" or \"auto\"; CPU workers have no "
        "e4m3 products");
  if (Fp8Matmuls(c) && !c.bench.fused_kernels)
    return Status::InvalidArgument(
        "train.dtype: \"fp8\" multiplies through the fused kernels' path; "
        "RP_FUSED_KERNELS=0 leaves no fp8 product");
  return Status::Ok();
}

// Pipeline layers: 0 = embedding, 1..L = blocks, L+1 = head. The tail holds the head and
// tail_blocks blocks, so forward stages cover [0, tail_start).
int64_t TailStart(const JobConfig& c) { return c.model.num_layers + 1 - c.schedule.tail_blocks; }

Status CheckTailAndKeptBlocks(const JobConfig& c) {
  if (c.schedule.tail_blocks > c.model.num_layers)
    return Status::InvalidArgument("schedule.tail_blocks: must be <= model.num_layers (" +
                                   std::to_string(c.model.num_layers) + "), got " +
                                   std::to_string(c.schedule.tail_blocks));
  const int64_t tail_start = TailStart(c);
  if (c.schedule.kept_blocks > tail_start - 1)
    return Status::InvalidArgument(
        "schedule.kept_blocks: " + std::to_string(c.schedule.kept_blocks) +
        " kept blocks, but only " + std::to_string(tail_start - 1) +
        " blocks precede the fused tail (model.num_layers - schedule.tail_blocks)");
  if (c.schedule.kept_blocks > 0 && c.train.mlp_tile_tokens != 0)
    return Status::InvalidArgument(
        "schedule.kept_blocks: a tiled MLP (train.mlp_tile_tokens) recomputes its tiles "
        "from weights the job that kept the graph no longer holds; not implemented "
        "together (kept_blocks = -1 keeps none when a tile is chosen)");
  if (c.schedule.kept_blocks > 0 && c.train.layer_recompute)
    return Status::InvalidArgument(
        "schedule.kept_blocks: keeps forward graphs for the backward, "
        "train.layer_recompute rebuilds them; choose one");
  for (int64_t b = tail_start - 1 - std::max<int64_t>(c.schedule.kept_blocks, 0);
       b < tail_start - 1; ++b)
    if (SparseBlock(c.model, b))
      return Status::InvalidArgument(
          "schedule.kept_blocks: block " + std::to_string(b) +
          " is a mixture-of-experts block, whose backward needs the load-balancing loss's "
          "gradient when its graph is built (known only after the tail); not implemented for "
          "kept blocks");
  return Status::Ok();
}

Status CheckCuts(const std::string& name, const std::vector<int64_t>& cuts, int64_t lo,
                 int64_t hi) {
  int64_t prev = lo - 1;
  for (size_t i = 0; i < cuts.size(); ++i) {
    if (cuts[i] < lo || cuts[i] > hi)
      return Status::InvalidArgument(name + "[" + std::to_string(i) + "]: layer " +
                                     std::to_string(cuts[i]) + " is outside [" +
                                     std::to_string(lo) + ", " + std::to_string(hi) + "]");
    if (cuts[i] <= prev)
      return Status::InvalidArgument(name + ": must be strictly ascending, got " +
                                     std::to_string(cuts[i]) + " after " + std::to_string(prev));
    prev = cuts[i];
  }
  return Status::Ok();
}

Status CheckStagesAndCuts(const JobConfig& c) {
  const int64_t tail_start = TailStart(c);
  if (c.schedule.forward_cuts.empty() && c.schedule.forward_stages > tail_start)
    return Status::InvalidArgument(
        "schedule.forward_stages: " + std::to_string(c.schedule.forward_stages) +
        " stages for only " + std::to_string(tail_start) + " forward layers");
  if (c.schedule.backward_cuts.empty() && c.schedule.backward_stages > tail_start)
    return Status::InvalidArgument(
        "schedule.backward_stages: " + std::to_string(c.schedule.backward_stages) +
        " stages for only " + std::to_string(tail_start) + " backward layers");
  if (c.schedule.partition.Read(ModeKeyGrant::Access()) == Partition::kAuto &&
      (!c.schedule.forward_cuts.empty() || !c.schedule.backward_cuts.empty()))
    return Status::InvalidArgument(
        "schedule.partition: \"auto\" chooses the cuts itself; remove "
        "schedule.forward_cuts and schedule.backward_cuts");
  RP_RETURN_IF_ERROR(
      CheckCuts("schedule.forward_cuts", c.schedule.forward_cuts, 1, tail_start - 1));
  return CheckCuts("schedule.backward_cuts", c.schedule.backward_cuts, 1, tail_start - 1);
}

Status CheckExports(const JobConfig& c) {
  if (c.checkpoint.export_every > 0 && c.checkpoint.export_hf.empty() &&
      !(c.lora.enabled() && !c.lora.export_dir.empty()))
    return Status::InvalidArgument(
        "checkpoint.export_every: nothing to export; set checkpoint.export_hf (or, "
        "with LoRA, lora.export)");
  return Status::Ok();
}

Status CheckStopAfter(const JobConfig& c) {
  if (c.train.epochs == 0 && c.train.stop_after > c.train.steps)
    return Status::InvalidArgument("train.stop_after: " + std::to_string(c.train.stop_after) +
                                   " is past train.steps (" + std::to_string(c.train.steps) + ")");
  return Status::Ok();
}

}  // namespace

const std::vector<CrossCheck>& CrossChecks() {
  // clang-format off
  static const std::vector<CrossCheck> table = {
      {"a device memory limit needs a device", {"job.device_memory_limit_gib"}, CheckDeviceMemoryLimit},
      {"experts of a model from job keys", {"model.experts_per_token", "model.num_experts", "model.router_aux_loss_coef"}, CheckExperts},
      {"the attention's shape", {"model.num_kv_heads", "model.head_dim", "data.seq_len"}, CheckAttentionShape},
      {"the data files", {"data.path", "model.vocab_size"}, CheckDataFiles},
      {"packing needs records", {"data.packing"}, CheckPacking},
      {"the eval set", {"data.eval_fraction", "data.eval_path", "train.eval_every"}, CheckEvalSet},
      {"adapters on expert tensors", {"lora.target_modules", "lora.target_parameters", "lora.dropout", "lora.rank"}, CheckLoraExpertTensors},
      {"adapters on projections", {"lora.target_modules", "lora.rank"}, CheckLoraModules},
      {"adapter keys without adapters", {"lora.init_from", "lora.target_parameters", "schedule.frozen_on_device"}, CheckLoraStart},
      {"planner choices need a budget", {"schedule.kept_blocks", "schedule.keep_attention", "train.mlp_tile_tokens"}, CheckBudgetedChoices},
      {"the learning rate's floor", {"optimizer.min_lr"}, CheckLearningRate},
      {"fp16's loss scaling", {"train.loss_scale_growth_factor", "train.loss_scale_backoff_factor", "train.loss_scale_*"}, CheckLossScaling},
      {"gradients that wait in workers", {"optimizer.gradients_wait_in"}, CheckGradientsWaitInWorkers},
      {"speculative updates", {"optimizer.speculative_update"}, CheckSpeculativeUpdate},
      {"updates on the device", {"optimizer.device_update_blocks"}, CheckDeviceUpdates},
      {"update passes", {"optimizer.update_passes", "optimizer.speculative_update", "optimizer.device_update_blocks"}, CheckUpdatePasses},
      {"fp8 products", {"train.dtype"}, CheckFp8},
      {"the fused tail and kept blocks", {"schedule.tail_blocks", "schedule.kept_blocks"}, CheckTailAndKeptBlocks},
      {"stages and cuts", {"schedule.forward_stages", "schedule.backward_stages", "schedule.partition", "schedule.forward_cuts", "schedule.backward_cuts"}, CheckStagesAndCuts},
      {"exports need a destination", {"checkpoint.export_every"}, CheckExports},
      {"stopping within the run", {"train.stop_after"}, CheckStopAfter},
  };
  // clang-format on
  return table;
}

Status CrossValidate(const JobConfig& job) {
  for (const CrossCheck& entry : CrossChecks()) {
    Status refusal = entry.check(job);
    if (!refusal.ok()) return refusal;
  }
  return Status::Ok();
}

}  // namespace rp::core
