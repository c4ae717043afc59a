// SPDX-License-Identifier: Apache-2.0
// Profile: what one job's layers and links cost, measured at the job's real microbatch shape.
//
// Contract:
//  * Workers time every layer of every microbatch of the jobs the coordinator marks for
//    profiling (RunJob.profile: the schedule.profile_steps steps after a warm-up step) and send
//    LayerTime messages; each worker also measures its host link once (LinkProbe). The
//    coordinator feeds everything to a ProfileBuilder, whose Build() takes medians (robust to a
//    stray slow microbatch) and writes <output_dir>/profile.json.
//  * A profile is tied to its workload (WorkloadKey: model shape, microbatch shape, compute
//    dtype, device kind). LoadProfile refuses another workload's profile by name instead of
//    planning with wrong numbers.
//  * Per-layer phases: forward (no autograd, forward stages), recompute (autograd forward in
//    backward stages and the tail) and backward. The head layer's chunked forward + loss +
//    backward cannot be separated, so its whole cost is in recompute_s and backward_s is 0.
//    A phase a layer never ran in (the tail's blocks are never in a forward stage) is filled
//    from the other layers' measured ratios and marked in `filled`.
//  * CostModelProfile() states the FLOP cost model in the same form, so the planner and the
//    simulator have one input type whether or not a measurement exists.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "planning/plan.h"

namespace rp::core {

inline constexpr int kProfileFormatVersion = 1;

struct LayerCost {
  double forward_s = 0.0;     // per microbatch
  double recompute_s = 0.0;   // per microbatch
  double backward_s = 0.0;    // per microbatch
  double saved_bytes = -1.0;  // device bytes the autograd forward keeps per microbatch; -1 unknown
  int samples = 0;            // measurements behind the medians (0: cost model)
  bool filled = false;        // some phase was derived from other layers, not measured
};

struct Profile {
  std::string source;             // "measured" or "cost-model"
  std::string workload;           // WorkloadKey() of the job measured
  std::vector<LayerCost> layers;  // one per pipeline layer (L + 2)
  double h2d_bytes_per_s = 0.0;   // host -> device, per worker; 0: free
  double d2h_bytes_per_s = 0.0;
  double optimizer_params_per_s = 0.0;  // coordinator update rate (AdamW over all threads)
  // Host memory bytes per parameter of the pass that rate timed, the one each layer's
  // publication waits for (core::UpdatePassBytes); 0: not recorded (the cost model, older
  // profiles), read as core::BuildSimInput says.
  double optimizer_pass_bytes = 0.0;
  // Per microbatch: measured interval minus layer compute minus the modelled activation
  // transfers (kernel launch gaps, synchronization, messages). Mean over the profile.
  double microbatch_overhead_s = 0.0;
  int profiled_steps = 0;

  // Per-layer costs the partitioner splits: forward stages and the backward chain.
  std::vector<double> ForwardCosts() const;
  std::vector<double> BackwardCosts() const;  // recompute + backward
};

std::string WorkloadKey(const JobConfig& config);

// schedule.keep_attention: what block `layer`'s recompute in a backward stage costs when its
// attention comes from the forward's record, `cost` its measured or modelled costs: its
// recompute_s less the attention core's share of it by the FLOP count (the core's forward FLOPs
// over the layer's). The layer's recompute_s for a layer that is no block.
double ReplayedRecompute(const JobConfig& config, const LayerCost& cost, int layer);

// Median of `v` (mean of the middle two for an even count); -1 for an empty vector.
double Median(std::vector<double> v);

// The FLOP cost model as a profile: a forward at `flops_per_s`, backward twice the forward (a
// fused attention core's 2.5 times; a tiled MLP's forward once more), host links at the given
// rates, the optimizer at `optimizer_params_per_s`.
Profile CostModelProfile(const JobConfig& config, double flops_per_s, double link_bytes_per_s,
                         double optimizer_params_per_s);
// The GPU the cost model assumes for CUDA workers (rp-plan --device). The layers are assumed to
// reach 0.7 of `bf16_flops_per_s` (bf16, fp16, fp8) or of `fp32_flops_per_s`, the host link to
// run at `link_bytes_per_s` each way, the coordinator's AdamW at `optimizer_params_per_s`.
struct DeviceModel {
  std::string name;
  double bf16_flops_per_s = 0.0;
  double fp32_flops_per_s = 0.0;
  double link_bytes_per_s = 0.0;
  double optimizer_params_per_s = 0.0;
  // Profile::optimizer_pass_bytes of that rate; 0: the models' rate (see H200Model).
  double optimizer_pass_bytes = 0.0;
  double memory_gb =
      0.0;             // what the device holds (for the reader; budgets are schedule.gpu_memory_gb)
  std::string source;  // where the numbers come from, in words
};
// The bytes per parameter of the pass rp-optim-bench times (adamw_params_per_s): gradient,
// master and moments read, master, moments and a bf16 copy written.
inline constexpr double kOptimBenchPassBytes = 30.0;
DeviceModel H200Model();
DeviceModel H100Model();
// "h200" or "h100"; anything else is an error naming the choices.
StatusOr<DeviceModel> DeviceModelNamed(const std::string& name);
// The default cost model for the config's device kind (used without a measured profile): CPU
// workers' rates, or `device`'s for CUDA workers.
Profile DefaultCostModel(const JobConfig& config, const DeviceModel& device = H200Model());

// Reads and validates a profile: format version, workload key (must equal the config's), one
// entry per pipeline layer, finite non-negative numbers. Errors name the file and the field.
StatusOr<Profile> LoadProfile(const std::string& path, const JobConfig& config);
Status SaveProfile(const std::string& path, const Profile& profile);
std::string ProfileToJson(const Profile& profile);

// Collects measurements during the profile steps.
class ProfileBuilder {
 public:
  explicit ProfileBuilder(int num_layers) : samples_(num_layers) {}
  // phase: 0 forward, 1 recompute, 2 backward (proto::LayerPhase); bytes < 0: not measured.
  // Phase 3 (a recompute whose attention came from a record, schedule.keep_attention) is not
  // taken: recompute_s is the whole autograd forward, and the planner takes the attention's share
  // off where records stand in (ReplayedRecompute).
  void AddLayer(int layer, int phase, double seconds, double saved_bytes);
  void AddLink(double h2d_bytes_per_s, double d2h_bytes_per_s);
  // The medians of the links reported so far (0 before any); kept across Clear().
  double H2dBytesPerS() const;
  double D2hBytesPerS() const;
  // One microbatch's measured interval and the part the model explains (compute + transfers).
  void AddMicrobatch(double interval_s, double explained_s);
  // `pass_bytes`: Profile::optimizer_pass_bytes of the run's updates.
  void AddOptimizer(double params, double busy_s, double pass_bytes);
  void AddStep() { steps_++; }
  // Medians; missing phases filled (see the header comment). Fails if a layer was never timed.
  StatusOr<Profile> Build(const JobConfig& config) const;
  void Clear();

 private:
  struct LayerSamples {
    std::vector<double> phase[3];
    std::vector<double> bytes;
  };
  std::vector<LayerSamples> samples_;
  std::vector<double> h2d_, d2h_, overhead_;
  double opt_params_ = 0.0, opt_busy_s_ = 0.0, opt_pass_bytes_ = 0.0;
  int steps_ = 0;
};

}  // namespace rp::core
