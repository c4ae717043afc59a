// SPDX-License-Identifier: Apache-2.0
#include "planning/partitioner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "config/model_spec.h"
#include "planning/grad_arena.h"
#include "planning/simulator.h"

namespace rp::core {
namespace {
// Steps simulated to predict the steady-state step (the first carries the pipeline fill).
constexpr int kPlanningSteps = 3;
// Steps simulated to compare the update passes (ResolveUpdatePasses).
constexpr int kPassesSteps = 8;
// Up to this many layers before the tail the search is exhaustive over contiguous splits.
constexpr int kExhaustiveLayers = 6;
// Every fused tail up to this many blocks is tried (TailCandidates), or up to the second number
// when the job sets no memory budget.
constexpr int kEveryTailUpTo = 8;
constexpr int kTailsWithoutBudget = 3;
// Forward side beyond that: first stages of up to this many layers are tried on their own.
constexpr int kFrontStageLayers = 6;

// Candidate stage starts for one side over costs.size() layers: every contiguous split when the
// layers are few (the search is then exact), else the equal and the min-max split for each stage
// count up to max_parts (and with `front_loaded`, the same after each short first stage).
std::vector<std::vector<int>> SideCandidates(const std::vector<double>& costs, int max_parts,
                                             bool front_loaded = false, bool finer = false) {
  const int t = static_cast<int>(costs.size());
  std::vector<std::vector<int>> out;
  if (t <= kExhaustiveLayers) {
    for (uint32_t mask = 0; mask < (1u << (t - 1)); ++mask) {
      std::vector<int> starts = {0};
      for (int i = 1; i < t; ++i)
        if (mask & (1u << (i - 1))) starts.push_back(i);
      out.push_back(std::move(starts));
    }
    return out;
  }
  for (int p = 1; p <= std::min(t, max_parts); ++p) {
    out.push_back(EqualCuts(t, p));
    out.push_back(MinMaxPartition(costs, p));
  }
  // Finer: more stages than the pipeline needs, for a budget that the coarse splits' working sets
  // overflow (a stage's recompute holds every block's activations at once). Steps of about a
  // third up to one layer per stage, which is the smallest working set a split can have.
  if (finer)
    for (int p = max_parts; p < t;) {
      p = std::min(t, std::max(p + 1, p * 4 / 3));
      out.push_back(EqualCuts(t, p));
      out.push_back(MinMaxPartition(costs, p));
    }
  if (!front_loaded) {
    if (finer) {
      std::sort(out.begin(), out.end());
      out.erase(std::unique(out.begin(), out.end()), out.end());
    }
    return out;
  }
  // A short first stage, then the equal and min-max splits of the rest: in exact mode the next
  // step's first stage waits for the update of all its layers after the step's last gradient,
  // while later stages find theirs done (the optimizer runs ahead of the forward), so a short
  // first stage starts the step sooner.
  for (int first = 1; first <= std::min(kFrontStageLayers, t - 1); ++first) {
    const std::vector<double> rest(costs.begin() + first, costs.end());
    for (int p = 1; p <= std::min(t - first, max_parts); ++p)
      for (const auto& cuts : {EqualCuts(t - first, p), MinMaxPartition(rest, p)}) {
        std::vector<int> starts = {0};
        for (int c : cuts) starts.push_back(first + c);
        out.push_back(std::move(starts));
      }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}
double MaxOf(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
}
}  // namespace

std::vector<int> MinMaxPartition(const std::vector<double>& costs, int parts) {
  const int n = static_cast<int>(costs.size());
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[p][i]: minimal largest sum splitting the first i items into p ranges.
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0.0;
  for (int p = 1; p <= parts; ++p)
    for (int i = p; i <= n; ++i)
      for (int j = p - 1; j < i; ++j) {
        const double v = std::max(best[p - 1][j], prefix[i] - prefix[j]);
        if (v < best[p][i]) {
          best[p][i] = v;
          cut[p][i] = j;
        }
      }
  std::vector<int> starts(parts);
  for (int p = parts, i = n; p >= 1; --p) {
    starts[p - 1] = cut[p][i];
    i = cut[p][i];
  }
  return starts;
}

namespace {

// What the estimate's parts share: the job's sizes in bytes and elements, decided once.
struct EstimateBasis {
  const JobConfig& c;
  const ExecutionPlan x;  // the decisions of the job being estimated (a trial may change a key)
  const PipelinePlan& plan;
  ModelSpec spec;
  double elem, tokens, H;
  int mapped_param;  // the embedding looked up in place (LookupInPlaceParam), or -1
  // CUDA workers with the fused kernels: projection and head gradients go into fp32 sinks
  // (worker::Executor, SinkableRole) and the head's loss chunk keeps only its logits.
  bool fused_cuda;

  EstimateBasis(const JobConfig& job, const PipelinePlan& p)
      : c(job),
        x(ResolveExecution(job)),
        plan(p),
        spec(BuildModelSpec(job.model, job.lora)),
        elem(static_cast<double>(core::ComputeElemBytes(job))),
        tokens(static_cast<double>(job.TokensPerMicrobatch())),
        H(static_cast<double>(job.model.hidden_size)),
        mapped_param(LookupInPlaceParam(x, spec)),
        fused_cuda(core::FusedKernelsApply(job) && job.job.device != core::DeviceKind::kCpu) {}

  // A use's gradient per element: its fp32 sum, and the microbatch's gradient in the compute
  // dtype unless it is summed into a sink.
  double GradientBytesPerElement(const std::string& role) const {
    return fused_cuda && SinkableRole(role) ? 4.0 : 4.0 + elem;
  }
};

// What a block holds, per token of the microbatch, in two parts (fitted to the allocator's peaks
// at long sequences, tiled and untiled; docs/benchmarks.md, "Planner accuracy", has the fit's
// errors):
//  * kept: what a block's graph saves for its backward: about 7.5 hidden-sized tensors tiled (a
//    tiled block recomputes each tile in the backward, so its graph keeps only the tile's input,
//    the residual stream); untiled, one more (the normed sequence the MLP reads) and its MLP's
//    three intermediate-sized ones, as a measured profile's saved bytes at 524,288 tokens and
//    the kept blocks' fit (KeptBlocksBytes) both found.
//  * working: what the one block being computed adds beside the kept tensors: about six
//    hidden-sized tensors (in a backward, the gradients flowing through it and the attention
//    kernel's fp32 accumulators; a forward without a graph holds fewer), and of intermediate size
//    three over one tile when tiled (the tile's recomputed intermediates and their gradients) but
//    only one untiled: the MLP's backward frees each kept intermediate as it consumes it, so its
//    gradients mostly take their place. Counting three would put blocks backpropagated alone
//    (their checkpoints in host slots) 15-22% above the peak at 262,144-524,288 tokens.
//    A measured profile records only the kept part, so the working set is added to it too.
struct BlockActivations {
  double kept = 0.0, working = 0.0;
};
BlockActivations PerBlockActivations(const EstimateBasis& e) {
  const JobConfig& c = e.c;
  const double tokens = e.tokens, H = e.H, elem = e.elem;
  const double tile = c.train.mlp_tile_tokens > 0
                          ? std::min(tokens, static_cast<double>(c.train.mlp_tile_tokens))
                          : tokens;
  BlockActivations a;
  bool dense = false, sparse = false;
  for (int64_t b = 0; b < c.model.num_layers; ++b)
    (SparseBlock(c.model, b) ? sparse : dense) = true;
  if (dense || !sparse) {
    const double I = static_cast<double>(c.model.intermediate_size);
    const bool tiled = tile < tokens;
    a.kept = tokens * (tiled ? 7.5 * H : 8.5 * H + 3.0 * I) * elem;
    a.working = (tokens * 6.0 * H + (tiled ? 3.0 * tile : tokens) * I) * elem;
  }
  if (sparse) {
    const double k = static_cast<double>(c.model.moe.experts_per_token);
    const double I =
        k * static_cast<double>(c.model.moe.expert_intermediate_size) + 2.0 * k * H / 3.0;
    a.kept = std::max(a.kept, tokens * (10.0 * H + 3.0 * I) * elem);
    a.working = std::max(a.working, tokens * (6.0 * H + 3.0 * I) * elem);
  }
  return a;
}

// One stage's weights, gradients and activations while it runs.
struct StageMemory {
  double weights = 0.0, gradients = 0.0, activations = 0.0, scores = 0.0, sums = 0.0;
};

StageMemory EstimateStage(const EstimateBasis& e, const BlockActivations& block, const Stage& st,
                          const Profile* profile) {
  const JobConfig& c = e.c;
  const PipelinePlan& plan = e.plan;
  const double tokens = e.tokens, H = e.H, elem = e.elem;
  // CPU workers compute attention explicitly (model::Transformer::Attention): fp32 scores of
  // every head, [microbatch_size, heads, seq, seq], and a causal mask of a byte per pair. Two such
  // tensors are alive at once besides what a graph keeps (an operation's input and output; in a
  // softmax's backward, the probabilities' gradient and the scores'), and a gradient stage's graph
  // keeps each block's probabilities and mask. Quadratic in the sequence (checked against a CPU
  // worker's resident memory at 8K tokens; at 32K one head's scores alone are 4 GiB). CUDA's fused
  // kernels keep no score.
  double scores = 0.0, mask = 0.0;
  if (c.job.device == core::DeviceKind::kCpu) {
    const double s = static_cast<double>(c.data.seq_len);
    scores = static_cast<double>(c.train.microbatch_size * c.model.num_heads) * s * s * 4.0;
    mask = s * s;
  }
  double params = 0.0;         // weights fetched
  double grads_of_uses = 0.0;  // of those, the trainable ones' gradients
  double mapped = 0.0;         // elements of the mapped embedding, when the stage has it
  double sums = 0.0;           // the job's fp32 gradient sums
  // A backward stage's kept layers come with their graphs, weights and sums (counted as `kept`,
  // KeptBlocksBytes): it fetches, recomputes and sums only the layers under them.
  const bool adopts = st.kind == StageKind::kBackward;
  for (int l = st.begin; l < st.end; ++l) {
    if (adopts && plan.KeepsGraph(l)) continue;
    // The embedding looked up in place takes no device copy; its gradient is fp32, a
    // microbatch's beside the job's sum.
    if (e.mapped_param >= 0 && l == 0) {
      mapped = static_cast<double>(e.spec.params[e.mapped_param].numel);
      continue;
    }
    // A base kept on the device counts once, as `frozen`.
    params += static_cast<double>(e.spec.LayerWeightBytes(l, 1, e.x.frozen_on_device ? 0 : 1));
    for (const auto& use : e.spec.layer_uses[l]) {
      const double numel = static_cast<double>(e.spec.params[use.param].numel);
      grads_of_uses += numel * e.GradientBytesPerElement(use.role);
      sums += numel * 4.0;
    }
  }
  const bool grads = st.kind != StageKind::kForward;
  // A gradient stage: every block's kept tensors and one block's working set; a forward stage
  // (no graph): one block's working set. train.layer_recompute: a gradient stage keeps each
  // block's input and one block's graph at a time. A fused tail counts its head's loss chunk
  // (below) beside the working set, though the two are not alive at once: the fit absorbed it.
  const int kept_here =
      adopts ? std::max(0, std::min(st.end, plan.tail_start) - std::max(st.begin, plan.kept_start))
             : 0;
  const double blocks = static_cast<double>(
      std::max(0, std::min(st.end, plan.num_layers - 1) - std::max(st.begin, 1) - kept_here));
  const double stage_working = blocks > 0 ? block.working : 0.0;
  const double kept_inputs = blocks * tokens * H * elem;
  double acts =
      stage_working + (!grads                    ? 0.0
                       : c.train.layer_recompute ? kept_inputs + std::min(blocks, 1.0) * block.kept
                                                 : blocks * block.kept);
  double stage_scores =
      blocks > 0 && scores > 0.0
          ? 2.0 * scores + mask +
                (grads ? (c.train.layer_recompute ? 1.0 : blocks) * (scores + mask) : 0.0)
          : 0.0;
  acts += stage_scores;
  // A layer-major forward stage (worker::Executor::ForwardLayers) holds every microbatch's hidden
  // state at once.
  if (MayRunLayerMajor(c, st, core::Round(c).microbatches))
    acts += static_cast<double>(core::Round(c).microbatches - 1) * tokens * H * elem;
  if (grads && profile) {  // measured: what each layer's autograd forward kept
    double measured = 0.0, largest = 0.0;
    bool all = true;
    for (int l = std::max(st.begin, 1); l < std::min(st.end, plan.num_layers - 1); ++l) {
      if (adopts && plan.KeepsGraph(l)) continue;
      all = all && profile->layers[l].saved_bytes >= 0;
      measured += profile->layers[l].saved_bytes;
      largest = std::max(largest, profile->layers[l].saved_bytes);
    }
    if (all) {
      // The profile measures what the graphs keep (the kept part), not the working set.
      acts = (c.train.layer_recompute ? kept_inputs + largest : measured) + stage_working;
      stage_scores = 0.0;  // measured: whatever the layers kept is in it
    }
  }
  // The head: one chunk's logits in the compute dtype; the composite loss adds fp32 logits, their
  // softmax and gradient (the fused kernel writes the gradient over the logits).
  if (st.end == plan.num_layers)
    acts += (e.fused_cuda ? elem : elem + 3.0 * 4.0) *
            std::min(static_cast<double>(c.train.loss_chunk_tokens), tokens) *
            static_cast<double>(c.model.vocab_size);
  StageMemory m;
  m.weights = params * elem;
  m.gradients = grads ? grads_of_uses + mapped * 8.0 : 0.0;
  m.activations = acts;
  m.scores = stage_scores;
  m.sums = grads ? sums + mapped * 4.0 : 0.0;
  return m;
}

// stale1 with clipping: a step's first commits wait for the whole previous update
// (coordinator/step_dispatch.cc, FirstCommitMayGo), which starts only once the previous step's
// norm is known, after its last commit. Meanwhile the worker goes on with this step's jobs and
// holds the sums of each gradient job it finished. The first step after a start does hold them
// all: the update before it is the slowest, writing the moments' pages for the first time.
bool HeldUntilPreviousUpdate(const ExecutionPlan& x) {
  return x.weight_version_lag > 0 && x.updates_wait_for_norm && !x.gradients_wait_in_workers;
}

// Per job position g of the step: the sums of the gradient jobs its worker ran earlier in the step
// (HeldUntilPreviousUpdate), held while job g runs; zeros otherwise.
std::vector<double> HeldBeforeEachJob(const EstimateBasis& e,
                                      const std::vector<StageMemory>& stages,
                                      const std::vector<JobSlot>& order, int64_t ahead) {
  std::vector<double> held(order.size(), 0.0);
  if (!HeldUntilPreviousUpdate(e.x)) return held;
  std::vector<double> per_worker(static_cast<size_t>(ahead), 0.0);
  for (size_t g = 0; g < order.size(); ++g) {
    double& worker = per_worker[g % static_cast<size_t>(ahead)];
    held[g] = worker;
    worker += stages[order[g].stage].sums;
  }
  return held;
}

// The job whose worker holds the most. While a job runs, its worker holds the weights of its
// next job: prefetched, or reserved (allocated, copied into as published) when the running job is
// a layer-major forward job. Jobs go to workers round-robin in the step's order (StepJobOrder:
// with interleaved calls F c0, F c1, T c0, B c0, T c1, B c1), so the next job of the job at
// position g is the one at g + workers, of this step or the next. (Pairing the worst stage with
// the largest weights of any stage overstates plans with one long stage, such as an auto plan
// whose last backward stage precedes a long forward stage.) A next job in the next step waits
// for this step's update in exact mode with clipping, which needs this job's gradients
// committed: unless this job reserves it, nothing of it is on the device while this job computes.
// Each job also counts `held_before` (HeldBeforeEachJob): the sums its worker holds meanwhile.
void FindWorstJob(const EstimateBasis& e, const std::vector<StageMemory>& stages,
                  const std::vector<JobSlot>& order, int64_t ahead,
                  const std::vector<double>& held_before, MemoryEstimate* out) {
  const JobConfig& c = e.c;
  const int64_t jobs_per_step = static_cast<int64_t>(order.size());
  const bool next_step_waits = e.x.NextStepWaitsForUpdate() && e.x.updates_wait_for_norm;
  double worst = 0.0;
  for (int64_t g = 0; g < jobs_per_step; ++g) {
    const int i = order[g].stage;
    const int n = order[(g + ahead) % jobs_per_step].stage;
    const bool reserves = MayRunLayerMajor(c, e.plan.stages[i], core::Round(c).microbatches);
    const bool waits = g + ahead >= jobs_per_step && next_step_waits && !reserves;
    const double next = waits ? 0.0 : stages[n].weights;
    const double job = stages[i].weights + stages[i].gradients + stages[i].activations + next;
    if (out->stage < 0 || job + held_before[g] > worst) {
      worst = job + held_before[g];
      out->stage = i;
      out->held_gradients = held_before[g];
      out->weights = stages[i].weights;
      out->next_weights = next;
      out->gradients = stages[i].gradients;
      out->activations = stages[i].activations;
      out->attention_scores = stages[i].scores;
    }
  }
}

// Gradients waiting in the workers for the norm: a worker holds every gradient job's sums it ran
// this step (job g runs on worker g mod workers) until the step's last gradient job is done.
double HeldGradientBytes(const EstimateBasis& e, const std::vector<StageMemory>& stages,
                         const std::vector<JobSlot>& order, int64_t ahead, int worst_stage) {
  if (!e.x.gradients_wait_in_workers) return 0.0;
  std::vector<double> per_worker(static_cast<size_t>(ahead), 0.0);
  for (size_t g = 0; g < order.size(); ++g)
    per_worker[g % static_cast<size_t>(ahead)] += stages[order[g].stage].sums;
  const double busiest = *std::max_element(per_worker.begin(), per_worker.end());
  double held = std::max(0.0, busiest - (worst_stage >= 0 ? stages[worst_stage].sums : 0.0));
  // stale1: step t + 1's jobs need only version t, so a worker may finish them and hold their
  // sums while step t's still wait for its norm.
  if (e.x.weight_version_lag > 0) held += busiest;
  return held;
}

// Kept blocks: a whole round's graphs and the blocks' weights in the compute dtype with their
// fp32 sums; twice over with interleaved calls, whose forward stages both run (each with its own
// weights) before the first call's backward. A kept block's graph holds about 8.6 hidden-sized
// and three intermediate-sized tensors per token (fitted to the allocator's peaks with two counts
// of kept blocks), about what an untiled block keeps (PerBlockActivations' kept part).
double KeptBlocksBytes(const EstimateBasis& e) {
  const JobConfig& c = e.c;
  const int kept_blocks = std::max(0, e.plan.tail_start - e.plan.kept_start);
  if (kept_blocks == 0) return 0.0;
  const double calls_in_flight = e.x.interleave_calls && core::Round(c).calls >= 2 ? 2.0 : 1.0;
  const double graph =
      e.tokens * (8.6 * e.H + 3.0 * static_cast<double>(c.model.intermediate_size)) * e.elem;
  double per_call =
      static_cast<double>(kept_blocks) * static_cast<double>(core::Round(c).microbatches) * graph;
  for (int l = e.plan.kept_start; l < e.plan.tail_start; ++l) {
    per_call +=
        static_cast<double>(e.spec.LayerWeightBytes(l, 1, e.x.frozen_on_device ? 0 : 1)) * e.elem;
    for (const auto& use : e.spec.layer_uses[l])
      per_call +=
          static_cast<double>(e.spec.params[use.param].numel) * e.GradientBytesPerElement(use.role);
  }
  return calls_in_flight * per_call;
}

// schedule.keep_attention: the attention output (the compute dtype) and its rows' fp32
// log-sum-exp, per query head, of each block KeepsAttention names, for every microbatch of a round
// (twice over with interleaved calls, as KeptBlocksBytes), held from its forward stage to its
// backward stage.
double KeptAttentionBytes(const EstimateBasis& e) {
  const JobConfig& c = e.c;
  int recomputed = 0;
  for (int l = 1; l < e.plan.num_layers - 1; ++l) recomputed += KeepsAttention(c, e.plan, l);
  if (recomputed == 0) return 0.0;
  const double calls_in_flight = e.x.interleave_calls && core::Round(c).calls >= 2 ? 2.0 : 1.0;
  const double record = e.tokens * static_cast<double>(c.model.num_heads) *
                        (static_cast<double>(c.model.head_dim) * e.elem + 4.0);
  return calls_in_flight * static_cast<double>(core::Round(c).microbatches) * recomputed * record;
}

// Device updates: the covered blocks' fp32 masters and moments (prefetched during the backward)
// and their fp32 gradients wait on the device for the step's constants, then their new weights in
// the compute dtype stay until the next step's update replaces them (PeakMemory says when they
// are there with what). With gradients waiting in the workers a covered gradient is one of the
// held ones.
void EstimateDeviceUpdates(const EstimateBasis& e, const std::vector<StageMemory>& stages,
                           MemoryEstimate* out) {
  const double state_bytes = e.x.gradients_wait_in_workers ? 12.0 : 16.0;
  double covered_gradients = 0.0;
  bool covered_kept = false;
  for (const auto& param : e.spec.params) {
    if (!e.x.DeviceUpdatesLayer(param.owner_layer)) continue;
    const double numel = static_cast<double>(param.numel);
    out->device_update += numel * (state_bytes + e.elem);
    out->device_update_weights += numel * e.elem;
    covered_gradients += numel * 4.0;
    covered_kept = covered_kept || e.plan.KeepsGraph(param.owner_layer);
  }
  // The kept blocks end where the tail begins, so while all their graphs are there this step holds
  // only the tail's gradients; the covered blocks' state arrives with their own backward stages,
  // after the kept graphs are gone, unless a covered block is itself kept. The previous step's
  // covered gradients are committed after every other stage's (the host updates those blocks
  // last, while the next backward runs), so through a small arena they may still wait on the
  // device while the kept graphs fill: with clipping, the covered blocks' weights and fp32
  // gradients show in the peak on top of the kept graphs. Exact mode only: in stale1 every
  // gradient of the previous step may still wait while this step's forward runs.
  out->kept_apart = e.x.gradients_wait_in_workers && e.x.NextStepWaitsForUpdate() && !covered_kept;
  if (out->kept_apart) {
    for (size_t i = 0; i < e.plan.stages.size(); ++i)
      if (e.plan.stages[i].kind == StageKind::kFusedTail) out->held_with_kept += stages[i].sums;
    out->covered_waiting = covered_gradients;
  }
}

}  // namespace

MemoryEstimate EstimateMemory(const JobConfig& c, const PipelinePlan& plan, int workers,
                              const Profile* profile) {
  const EstimateBasis e(c, plan);
  const BlockActivations block = PerBlockActivations(e);
  std::vector<StageMemory> stages;
  for (const auto& st : plan.stages) stages.push_back(EstimateStage(e, block, st, profile));
  MemoryEstimate out;
  const int calls = static_cast<int>(std::max<int64_t>(1, core::Round(c).calls));
  const auto order = StepJobOrder(plan, calls, e.x.interleave_calls);
  const int64_t ahead = std::max(1, workers);
  FindWorstJob(e, stages, order, ahead, HeldBeforeEachJob(e, stages, order, ahead), &out);
  // schedule.activations = "worker": every hidden-state and input-gradient slot lives on the
  // device (as the shared-memory layout would hold them: parities x microbatches x slots); an
  // activation pool (activations = "cuda_ipc") holds the same in every worker.
  if (e.x.ActivationsInWorkers()) {
    out.resident = static_cast<double>(e.x.activation_parities) *
                   static_cast<double>(core::Round(c).microbatches) *
                   plan.ActivationSlotsPerMicrobatch() * e.tokens * e.H * e.elem;
  }
  // Fetching fp32 masters for bf16 compute rounds them through one 64 MiB staging chunk.
  if (e.x.workers_fetch_masters && e.elem == 2.0 && c.job.device != core::DeviceKind::kCpu)
    out.staging = 64.0 * (1 << 20);
  if (e.x.gradients_wait_in_workers)
    out.held_gradients = HeldGradientBytes(e, stages, order, ahead, out.stage);
  out.kept = KeptBlocksBytes(e);
  out.kept_attention = KeptAttentionBytes(e);
  // The frozen base every worker keeps (ExecutionPlan::frozen_on_device): all of it, copied at its
  // first fetch, whichever stages it runs (evaluations read every layer).
  out.frozen = e.x.frozen_on_device ? static_cast<double>(e.spec.FrozenParams()) * e.elem : 0.0;
  EstimateDeviceUpdates(e, stages, &out);
  out.total = PeakMemory(c, &out, 0.0);
  return out;
}

double PeakMemory(const JobConfig& c, MemoryEstimate* m, double simulated_held) {
  // Kept attention records wait from the forward to the backward, as kept graphs do.
  const double kept = m->kept + m->kept_attention;
  const double common = m->weights + m->next_weights + m->gradients + m->activations + m->resident +
                        m->staging + m->frozen;
  const double parts = common + kept + m->held_gradients + simulated_held + m->device_update;
  double peak = parts;
  const ExecutionPlan x = ResolveExecution(c);
  // Held until the previous update: the sums waiting for slots are among them, counted once.
  if (HeldUntilPreviousUpdate(x))
    peak = common + kept + std::max(m->held_gradients, simulated_held) + m->device_update;
  if (x.gradients_wait_in_workers) {
    const double held = std::max(m->held_gradients, simulated_held);
    // kept_apart: at the forward's end every kept graph, the tail's gradients (among this step's
    // held ones), the covered blocks' weights of the last update and their gradients of the
    // previous step; at the backward's end every held gradient and the covered blocks' state,
    // the kept graphs gone. Otherwise all at once.
    const double forward_end =
        kept + std::min(m->held_with_kept, held) + m->covered_waiting + m->device_update_weights;
    const double backward_end = held + m->device_update;
    peak = common +
           (m->kept_apart ? std::max(forward_end, backward_end) : kept + held + m->device_update);
  }
  m->not_at_once = parts - peak;
  return peak;
}

double EstimatePeakMemory(const JobConfig& c, const PipelinePlan& plan, int workers,
                          const Profile* profile) {
  return EstimateMemory(c, plan, workers, profile).total;
}

StatusOr<Profile> PlanningProfile(const JobConfig& c, const DeviceModel& device) {
  if (c.schedule.profile.empty()) return DefaultCostModel(c, device);
  return LoadProfile(c.schedule.profile, c);
}

PlanChoice PredictPlan(const JobConfig& c, const PipelinePlan& plan, const Profile& profile,
                       int workers) {
  const ModelSpec spec = BuildModelSpec(c.model, c.lora);
  PlanChoice out;
  out.plan = plan;
  out.cost_source = profile.source;
  auto steady = Simulate(BuildSimInput(c, spec, plan, profile, workers, kPlanningSteps));
  auto first = Simulate(BuildSimInput(c, spec, plan, profile, workers, 1));
  out.step_seconds = steady.steady_step_s;
  out.bubble_ratio = steady.steady_bubble_ratio;
  out.first_step_seconds = first.makespan;
  out.fill_ratio = first.fill_ratio;
  out.drain_ratio = first.drain_ratio;
  out.imbalance_ratio = first.imbalance_ratio;
  out.memory = EstimateMemory(c, plan, workers, &profile);
  out.held_grad_bytes = MaxOf(steady.peak_held_grad_bytes);
  out.peak_memory_bytes = PeakMemory(c, &out.memory, out.held_grad_bytes);
  return out;
}

std::vector<int> TailCandidates(int blocks, bool memory_bounded) {
  std::vector<int> tails;
  const int every = memory_bounded ? kEveryTailUpTo : kTailsWithoutBudget;
  for (int t = 0; t <= std::min(blocks, every); ++t) tails.push_back(t);
  if (!memory_bounded) return tails;
  // Beyond: steps of about a third, so a deep model adds a handful of sizes, and every block.
  for (int t = every; t < blocks;) {
    t = std::max(t + 1, t * 4 / 3);
    tails.push_back(std::min(t, blocks));
  }
  return tails;
}

StatusOr<PlanChoice> ChoosePlan(const JobConfig& c, int workers) {
  RP_ASSIGN_OR_RETURN(Profile profile, PlanningProfile(c));
  return ChoosePlan(c, workers, profile);
}

StatusOr<PlanChoice> ChoosePlan(const JobConfig& c, int workers, const Profile& profile,
                                const SharedBytesOf& shared_bytes) {
  const ModelSpec spec = BuildModelSpec(c.model, c.lora);
  const int L = static_cast<int>(c.model.num_layers);
  const double limit = c.schedule.gpu_memory_gb * 1e9;
  const double host_limit = c.schedule.host_memory_gb * 1e9;
  if (host_limit > 0 && !shared_bytes)
    return Status::Internal(
        "schedule.host_memory_gb: the planner was given no count of a plan's "
        "shared memory");
  double smallest_host = std::numeric_limits<double>::infinity();
  std::string host_error;  // a plan whose shared memory could not be counted
  const std::vector<double> fwd_cost = profile.ForwardCosts();
  const std::vector<double> bwd_cost = profile.BackwardCosts();
  double best_step = std::numeric_limits<double>::infinity();
  PipelinePlan best_plan;
  int best_jobs = std::numeric_limits<int>::max();
  int candidates = 0;
  double smallest_memory = std::numeric_limits<double>::infinity();
  JobConfig probe = c;
  probe.schedule.partition = core::Partition::kEqual;
  // One search over tails and both sides' splits; `finer` adds stage counts beyond the
  // pipeline's needs (SideCandidates), tried only when no coarse plan fits the budget, so a job
  // that fits keeps the plan it had and its search time.
  auto search = [&](bool finer) {
    double previous_tail_best = std::numeric_limits<double>::infinity();
    for (int tail : TailCandidates(L, limit > 0)) {
      const int t = L + 1 - tail;  // layers before the tail
      probe.schedule.tail_blocks = tail;
      double tail_best = std::numeric_limits<double>::infinity();
      const std::vector<double> f_layers(fwd_cost.begin(), fwd_cost.begin() + t);
      std::vector<double> b_layers(bwd_cost.begin(), bwd_cost.begin() + t);
      // Kept blocks under this tail cost their backward only: the backward cuts balance that.
      for (int l = KeptStart(probe, t); l < t; ++l) b_layers[l] = profile.layers[l].backward_s;
      for (const auto& fc : SideCandidates(f_layers, 2 * workers + 2, /*front_loaded=*/true, finer))
        for (const auto& bc :
             SideCandidates(b_layers, 3 * workers + 3, /*front_loaded=*/false, finer)) {
          // Counts too: a single-stage side has no cuts and BuildPlan then reads the count.
          probe.schedule.forward_stages = static_cast<int>(fc.size());
          probe.schedule.backward_stages = static_cast<int>(bc.size());
          probe.schedule.forward_cuts.assign(fc.begin() + 1, fc.end());
          probe.schedule.backward_cuts.assign(bc.begin() + 1, bc.end());
          auto plan = BuildPlan(probe);
          if (!plan.ok()) continue;
          candidates++;
          MemoryEstimate estimate = EstimateMemory(probe, *plan, workers, &profile);
          const double mem = estimate.total;
          // Over before any gradient waits: skip the simulation unless nothing has fit so far (the
          // error then names the smallest complete estimate, not a partial one).
          if (limit > 0 && mem > limit && mem >= smallest_memory) continue;
          auto sim = Simulate(BuildSimInput(probe, spec, *plan, profile, workers, kPlanningSteps));
          const double total_mem = PeakMemory(probe, &estimate, MaxOf(sim.peak_held_grad_bytes));
          smallest_memory = std::min(smallest_memory, total_mem);
          if (limit > 0 && total_mem > limit) continue;
          const int jobs = static_cast<int>(plan->stages.size());
          // A plan must be clearly faster to justify more stage jobs (each costs a fetch).
          const bool better = sim.steady_step_s < best_step * (1.0 - 1e-6) ||
                              (sim.steady_step_s <= best_step * (1.0 + 1e-6) && jobs < best_jobs);
          // The shared memory is counted (a layout) only for a plan that would matter here.
          if (host_limit > 0 && (better || sim.steady_step_s < tail_best)) {
            auto bytes = shared_bytes(probe, *plan);
            if (!bytes.ok()) {
              host_error = bytes.status().message();
              continue;
            }
            smallest_host = std::min(smallest_host, static_cast<double>(*bytes));
            if (static_cast<double>(*bytes) > host_limit) continue;
          }
          tail_best = std::min(tail_best, sim.steady_step_s);
          if (better) {
            best_plan = *plan;
            best_step = sim.steady_step_s;
            best_jobs = jobs;
          }
        }
      // Past the tails tried without a budget, on a model too deep to try every size: stop once a
      // longer tail no longer pays. The step falls with the tail while the recompute saved
      // outweighs the longer tail job and boundary, then rises, and each size costs a full search
      // (a multi-worker job of a deep model: tens of seconds in every process).
      if (L > kEveryTailUpTo && tail > kTailsWithoutBudget && !(tail_best < previous_tail_best))
        break;
      previous_tail_best = tail_best;
    }
  };
  search(/*finer=*/false);
  if (best_jobs == std::numeric_limits<int>::max() && (limit > 0 || host_limit > 0))
    search(/*finer=*/true);
  if (best_jobs == std::numeric_limits<int>::max()) {
    if (!host_error.empty() && std::isinf(smallest_host))
      return Status::InvalidArgument("schedule.host_memory_gb: " + host_error);
    if (std::isfinite(smallest_host)) {
      char text[160];
      std::snprintf(text, sizeof(text),
                    "no plan that fits the device fits in %.2f GB of shared memory; the smallest "
                    "takes %.2f GB",
                    c.schedule.host_memory_gb, smallest_host / 1e9);
      return Status::InvalidArgument(
          std::string("schedule.host_memory_gb: ") + text +
          " (weights, optimizer state, gradient arena and activation slots; without the limit "
          "rp-launch --dry-run shows where they go): raise the limit, or shorten data.seq_len");
    }
    return Status::InvalidArgument("schedule.gpu_memory_gb: no plan fits in " +
                                   std::to_string(c.schedule.gpu_memory_gb) +
                                   " GB per worker; the smallest estimate is " +
                                   std::to_string(smallest_memory / 1e9) + " GB");
  }
  PlanChoice best = PredictPlan(c, best_plan, profile, workers);
  best.candidates = candidates;
  return best;
}

namespace {

// The plan `trial` would run under the FLOP cost model (never a measured profile: the automatic
// choices below must come out the same at every start of a run, whatever profile it has by then):
// ChoosePlan's for partition = "auto", none when no candidate fits; else the job's own plan with
// its prediction. Under the device budget alone unless `shared_bytes` comes with the host limit
// (MakePlan applies the limit either way).
StatusOr<std::optional<PlanChoice>> CostModelChoice(JobConfig trial, int workers,
                                                    const SharedBytesOf& shared_bytes) {
  if (!shared_bytes) trial.schedule.host_memory_gb = 0.0;
  const Profile costs = DefaultCostModel(trial);
  if (ResolveExecution(trial).planner_chooses_partition) {
    auto choice = ChoosePlan(trial, workers, costs, shared_bytes);  // fails only when none fits
    return choice.ok() ? std::optional<PlanChoice>(*std::move(choice)) : std::nullopt;
  }
  RP_ASSIGN_OR_RETURN(PipelinePlan plan, BuildPlan(trial));
  return std::optional<PlanChoice>(PredictPlan(trial, plan, costs, workers));
}

// Whether `trial` has a plan that fits (CostModelChoice): ChoosePlan found one within the limits,
// or the job's own plan's estimate is within schedule.gpu_memory_gb.
StatusOr<bool> PlanFits(const JobConfig& trial, int workers, const SharedBytesOf& shared_bytes) {
  RP_ASSIGN_OR_RETURN(const auto choice, CostModelChoice(trial, workers, shared_bytes));
  if (ResolveExecution(trial).planner_chooses_partition) return choice.has_value();
  return choice->peak_memory_bytes <= trial.schedule.gpu_memory_gb * 1e9;
}

// The largest count in 0..most whose trial plan fits schedule.gpu_memory_gb, `key` the count's
// field in the trial job. More never needs less memory, so those that fit are a prefix of
// 0..most: a bisection.
StatusOr<int64_t> MostThatFit(const JobConfig& c, int workers, int64_t ScheduleConfig::*key,
                              int64_t most, const SharedBytesOf& shared_bytes = {}) {
  auto fits = [&](int64_t k) {
    JobConfig trial = c;
    trial.schedule.*key = k;
    return PlanFits(trial, workers, shared_bytes);
  };
  int64_t lo = 0, hi = most;  // lo fits (or is 0); once bisecting, hi does not
  RP_ASSIGN_OR_RETURN(const bool all, fits(most));
  if (all) return most;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    RP_ASSIGN_OR_RETURN(const bool ok, fits(mid));
    (ok ? lo : hi) = mid;
  }
  return lo;
}
}  // namespace

Status ResolveKeptAttention(JobConfig* c, int workers, const SharedBytesOf& shared_bytes) {
  if (c->schedule.keep_attention != kKeepAttentionAuto) return Status::Ok();
  c->schedule.keep_attention = 0;
  if (workers != 1 || c->nodes.count > 1) return Status::Ok();
  // Every block a backward stage may recompute: those below the kept blocks and the tail (any
  // tail when the planner chooses it).
  const int64_t tail = ResolveExecution(*c).planner_chooses_partition ? 0 : c->schedule.tail_blocks;
  const int64_t most = std::max<int64_t>(
      0, c->model.num_layers - tail - std::max<int64_t>(c->schedule.kept_blocks, 0));
  RP_ASSIGN_OR_RETURN(c->schedule.keep_attention,
                      MostThatFit(*c, workers, &ScheduleConfig::keep_attention, most,
                                  c->schedule.host_memory_gb > 0 ? shared_bytes : SharedBytesOf()));
  return Status::Ok();
}

Status ResolveKeptBlocks(JobConfig* c, int workers) {
  if (c->schedule.kept_blocks != kKeptBlocksAuto) return Status::Ok();
  c->schedule.kept_blocks = 0;
  if (workers != 1 || c->nodes.count > 1 || c->train.layer_recompute ||
      c->train.mlp_tile_tokens != 0)
    return Status::Ok();
  // Blocks just before the tail, up to the first sparse one (kept blocks must be dense).
  int64_t most = 0;
  for (int64_t b = c->model.num_layers - c->schedule.tail_blocks - 1;
       b >= 0 && !SparseBlock(c->model, b); --b)
    ++most;
  RP_ASSIGN_OR_RETURN(c->schedule.kept_blocks,
                      MostThatFit(*c, workers, &ScheduleConfig::kept_blocks, most));
  return Status::Ok();
}

StatusOr<UpdatePassesChoice> ResolveUpdatePasses(JobConfig* c, int workers, const Profile& profile,
                                                 const PipelinePlan& plan) {
  UpdatePassesChoice out;
  const ExecutionPlan x = ResolveExecution(*c);
  out.chosen = x.planner_chooses_update_passes;
  const ModelSpec spec = BuildModelSpec(c->model, c->lora);
  // Two passes need exact mode (stale1's one pass has nothing to wait for) and an arena that
  // holds every slot (a streamed one frees a slot only after its whole update).
  bool holds_every_slot = false;
  if (x.NextStepWaitsForUpdate()) {
    RP_ASSIGN_OR_RETURN(const GradArenaSizing sizing, SizeGradArena(*c, x, spec, plan));
    holds_every_slot = sizing.chosen >= sizing.all_slots;
  }
  if (!holds_every_slot) {
    if (!out.chosen && x.two_pass_updates)
      return Status::InvalidArgument(
          "optimizer.update_passes = 2: two passes need exact mode and a gradient arena that holds "
          "every gradient (train.grad_clip > 0, fp16 or train.accum_calls > 1, with "
          "optimizer.gradients_wait_in = \"host\", or a larger optimizer.grad_buffer_mb); this "
          "job updates in one pass: set 1 or 0");
    if (out.chosen) c->optimizer.update_passes = int64_t{1};
    out.passes = 1;
    return out;
  }
  out.passes = x.two_pass_updates ? 2 : 1;
  if (!out.chosen) return out;
  // Speculation and device updates are built on the first pass: they keep two.
  if (x.speculative_update || x.device_update_blocks > 0) {
    c->optimizer.update_passes = int64_t{2};
    out.passes = 2;
    return out;
  }
  // Where the optimizer bounds the step, each step's second passes delay the next step's first
  // ones, and the period settles only after a few steps: simulate kPassesSteps and take the
  // later half's period.
  auto predict = [&](int64_t passes) {
    JobConfig trial = *c;
    trial.optimizer.update_passes = passes;
    const SimResult r = Simulate(BuildSimInput(trial, spec, plan, profile, workers, kPassesSteps));
    const int half = kPassesSteps / 2;
    return (r.step_done[kPassesSteps - 1] - r.step_done[half - 1]) /
           static_cast<double>(kPassesSteps - half);
  };
  out.one_pass_step_s = predict(1);
  out.two_pass_step_s = predict(2);
  // Ties keep two passes (CPU workers' cost model prices no update at all).
  out.passes = out.one_pass_step_s < out.two_pass_step_s ? 1 : 2;
  c->optimizer.update_passes = out.passes;
  return out;
}

namespace {

// The cost model's step time of `c` as the run would plan it; infinite when nothing fits.
StatusOr<double> PredictedStepSeconds(const JobConfig& c, int workers,
                                      const SharedBytesOf& shared_bytes) {
  RP_ASSIGN_OR_RETURN(const auto choice, CostModelChoice(c, workers, shared_bytes));
  return choice ? choice->step_seconds : std::numeric_limits<double>::infinity();
}

// With schedule.keep_attention = -1 as well, the largest tile that fits (tiles[fit], already in
// `c`) may leave too little memory for the records: at a million tokens an untiled block fits
// 126 GB with two records where 524,288-token tiles leave room for five, and a record saves a
// block's attention forward, which at length costs far more than running its MLP forward again
// in tiles. So the smallest tile's count of records is found, and the largest tile that still
// keeps that many is taken when the cost model (which charges the tiles' extra forward) says
// its step is shorter. Under the memories the tile was chosen for (`shared_bytes` empty: the
// device's alone); the count itself is left to ResolveKeptAttention.
Status PreferATileKeepingMoreAttention(JobConfig* c, int workers, const std::vector<int64_t>& tiles,
                                       size_t fit, const SharedBytesOf& shared_bytes) {
  auto with = [&](size_t i) {
    JobConfig trial = *c;
    trial.train.mlp_tile_tokens = tiles[i];
    return trial;
  };
  auto records_at = [&](size_t i) -> StatusOr<int64_t> {
    JobConfig trial = with(i);
    RP_RETURN_IF_ERROR(ResolveKeptAttention(&trial, workers, shared_bytes));
    return trial.schedule.keep_attention;
  };
  // Whether tiles[i] lets `records` blocks keep theirs: one plan search where a count is several.
  auto keeps = [&](size_t i, int64_t records) {
    JobConfig trial = with(i);
    trial.schedule.keep_attention = records;
    return PlanFits(trial, workers, shared_bytes);
  };
  const size_t last = tiles.size() - 1;
  RP_ASSIGN_OR_RETURN(const int64_t most, records_at(last));
  if (most == 0) return Status::Ok();
  RP_ASSIGN_OR_RETURN(const bool all_at_fit, keeps(fit, most));
  if (all_at_fit) return Status::Ok();
  size_t lo = fit, hi = last;  // lo keeps fewer than `most`, hi keeps `most`
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    RP_ASSIGN_OR_RETURN(const bool ok, keeps(mid, most));
    (ok ? hi : lo) = mid;
  }
  RP_ASSIGN_OR_RETURN(const int64_t at_fit, records_at(fit));
  JobConfig larger = with(fit), smaller = with(hi);
  larger.schedule.keep_attention = at_fit;
  smaller.schedule.keep_attention = most;
  RP_ASSIGN_OR_RETURN(const double larger_s, PredictedStepSeconds(larger, workers, shared_bytes));
  RP_ASSIGN_OR_RETURN(const double smaller_s, PredictedStepSeconds(smaller, workers, shared_bytes));
  if (smaller_s < larger_s) c->train.mlp_tile_tokens = tiles[hi];
  return Status::Ok();
}

}  // namespace

Status ResolveMlpTile(JobConfig* c, int workers, const SharedBytesOf& shared_bytes) {
  if (c->train.mlp_tile_tokens != kMlpTileAuto) return Status::Ok();
  const int64_t tokens = c->TokensPerMicrobatch();
  std::vector<int64_t> tiles = {0};
  int64_t pow2 = 1;
  while (pow2 * 2 < tokens) pow2 *= 2;
  for (int64_t t = pow2; t >= kSmallestAutoMlpTile && t < tokens; t /= 2) tiles.push_back(t);
  const bool both = c->schedule.host_memory_gb > 0 && shared_bytes;
  // The estimated peak with tiles[i], as the run would plan it (CostModelChoice: the cost model,
  // since a profile's saved bytes were measured at one tile and would rate every tile alike).
  // Under both memories when the job has a host limit: a tile that fits the device may leave no
  // plan that fits the host, which a smaller one would, more of its checkpoints on the device.
  auto peak_with = [&](size_t i) -> StatusOr<double> {
    JobConfig trial = *c;
    trial.train.mlp_tile_tokens = tiles[i];
    RP_ASSIGN_OR_RETURN(const auto choice,
                        CostModelChoice(trial, workers, both ? shared_bytes : SharedBytesOf()));
    return choice ? choice->peak_memory_bytes : std::numeric_limits<double>::infinity();
  };
  const double limit = c->schedule.gpu_memory_gb * 1e9;
  // A smaller tile never needs more memory (its intermediates shrink; the tiles' saved inputs
  // are one sequence's whatever the size), so the tiles that fit are a suffix of `tiles`: untiled
  // first (most jobs fit it), then the smallest, then bisection between. Each try is a whole
  // plan search with partition = "auto"; trying every size made rp-plan --max-seq twice as slow.
  RP_ASSIGN_OR_RETURN(const double untiled, peak_with(0));
  double smallest = untiled;
  size_t fit = tiles.size();  // the first index known to fit
  if (untiled <= limit) {
    fit = 0;
  } else if (tiles.size() > 1) {
    RP_ASSIGN_OR_RETURN(const double last, peak_with(tiles.size() - 1));
    smallest = std::min(smallest, last);
    if (last <= limit) {
      fit = tiles.size() - 1;
      size_t lo = 0;  // known not to fit
      while (fit - lo > 1) {
        const size_t mid = lo + (fit - lo) / 2;
        RP_ASSIGN_OR_RETURN(const double peak, peak_with(mid));
        (peak <= limit ? fit : lo) = mid;
      }
    }
  }
  if (fit < tiles.size()) {
    c->train.mlp_tile_tokens = tiles[fit];
    if (c->schedule.keep_attention == kKeepAttentionAuto && fit + 1 < tiles.size())
      return PreferATileKeepingMoreAttention(c, workers, tiles, fit,
                                             both ? shared_bytes : SharedBytesOf());
    return Status::Ok();
  }
  char text[320];
  if (tiles.size() == 1)
    std::snprintf(
        text, sizeof(text),
        "train.mlp_tile_tokens = -1: a microbatch of %lld tokens is not longer than the smallest "
        "tile tried "
        "(%lld), and untiled it fits no plan within schedule.gpu_memory_gb = %.2f GB per worker",
        static_cast<long long>(tokens), static_cast<long long>(kSmallestAutoMlpTile),
        c->schedule.gpu_memory_gb);
  else
    std::snprintf(text, sizeof(text),
                  "train.mlp_tile_tokens = -1: no MLP tile from the whole microbatch (%lld tokens) "
                  "down to %lld lets a "
                  "plan fit schedule.gpu_memory_gb = %.2f GB per worker",
                  static_cast<long long>(tokens), static_cast<long long>(kSmallestAutoMlpTile),
                  c->schedule.gpu_memory_gb);
  std::string why = text;
  if (both) {
    std::snprintf(text, sizeof(text), " and schedule.host_memory_gb = %.2f GB of shared memory",
                  c->schedule.host_memory_gb);
    why += text;
  }
  if (std::isfinite(smallest)) {
    std::snprintf(text, sizeof(text), "; the smallest estimate is %.2f GB", smallest / 1e9);
    why += text;
  }
  return Status::InvalidArgument(
      why +
      (both ? " (a higher schedule.host_memory_gb, shorter sequences, train.layer_recompute or "
              "more workers may fit)"
            : " (shorter sequences, train.layer_recompute or more workers may fit)"));
}

std::optional<PlanChoice> FrozenOnDeviceAlternative(const JobConfig& c, int workers,
                                                    const Profile& profile,
                                                    double current_step_seconds,
                                                    const SharedBytesOf& shared_bytes) {
  if (!c.lora.enabled() || ResolveExecution(c).frozen_on_device || c.job.device == DeviceKind::kCpu)
    return std::nullopt;
  JobConfig kept = c;
  kept.schedule.frozen_on_device = true;
  std::optional<PlanChoice> alt;
  if (ResolveExecution(kept).planner_chooses_partition) {
    auto chosen = ChoosePlan(kept, workers, profile, shared_bytes);
    if (!chosen.ok()) return std::nullopt;  // no plan fits the memory budgets with the base kept
    alt = std::move(chosen).value();
  } else {
    auto plan = BuildPlan(kept);
    if (!plan.ok()) return std::nullopt;
    alt = PredictPlan(kept, *plan, profile, workers);
    if (kept.schedule.gpu_memory_gb > 0 &&
        alt->peak_memory_bytes > kept.schedule.gpu_memory_gb * 1e9)
      return std::nullopt;
  }
  if (alt->step_seconds > 0.99 * current_step_seconds) return std::nullopt;
  return alt;
}

StatusOr<PipelinePlan> MakePlan(const JobConfig& c, int workers,
                                const SharedBytesOf& shared_bytes) {
  if (!ResolveExecution(c).planner_chooses_partition) return BuildPlan(c);
  RP_ASSIGN_OR_RETURN(Profile profile, PlanningProfile(c));
  RP_ASSIGN_OR_RETURN(PlanChoice choice, ChoosePlan(c, workers, profile, shared_bytes));
  return choice.plan;
}

}  // namespace rp::core
