// SPDX-License-Identifier: Apache-2.0
// rp-block-bench: device time of one decoder block and of the LM head at a job's microbatch
// shape, through the same model::Transformer calls a worker makes (forward stage, recompute +
// backward, gradient accumulation, fused head), on the backend the job selects.
//   rp-block-bench JOB.toml [--set section.key=value ...] [--reps R] [--profile]
//                  [--attention default,flash,cudnn,efficient]
// Prints one JSON line per attention backend tried: milliseconds per microbatch and TFLOP/s for
// each phase, and with --profile the kernels that took the most device time in each phase
// (LibTorch's Kineto profiler), so a kernel change can be judged before a whole run.
// A measuring tool, not part of the runtime: weights are random, nothing touches shared memory.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/exit_codes.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "gpu_worker/device.h"
#include "gpu_worker/kernel_trace.h"
#include "model/transformer.h"

namespace {

using rp::model::LayerWeights;

// Random weights for pipeline layer `l`: projections ~ N(0, 1/fan_in), norms 1, in `dtype`, each
// a leaf that collects a gradient.
LayerWeights MakeWeights(const rp::core::ModelSpec& spec, int l, at::TensorOptions opts) {
  LayerWeights w;
  for (const auto& use : spec.layer_uses[l]) {
    const auto& shape = spec.params[use.param].shape;
    at::Tensor t = shape.size() == 1
                       ? at::ones(shape, opts)
                       : at::randn(shape, opts).div_(std::sqrt(static_cast<double>(shape[1])));
    w.emplace(use.role, t.requires_grad_(true));
  }
  return w;
}

void ResetGrads(LayerWeights& w) {
  for (auto& [role, t] : w) t.mutable_grad().reset();
}

struct KernelTime {
  double us = 0.0;
  int64_t count = 0;
};

// Device time per kernel name over one call of `f`, or an empty map where this LibTorch has no
// Kineto (the profiler throws).
std::map<std::string, KernelTime> ProfileKernels(const std::function<void()>& f, bool cuda,
                                                 rp::worker::Device& device) {
  std::map<std::string, KernelTime> out;
  try {
    rp::worker::StartKineto();
    f();
    device.MarkSeconds(device.Mark(), device.Mark());  // waits for the device
    auto result = rp::worker::StopKineto();
    for (const auto& e : result->events()) {
      if (cuda && e.deviceType() != c10::DeviceType::CUDA) continue;
#if TORCH_VERSION_MAJOR >= 2
      const double us = static_cast<double>(e.durationNs()) / 1000.0;
#else
      const double us = static_cast<double>(e.durationUs());
#endif
      auto& k = out[e.name()];
      k.us += us;
      ++k.count;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "profiler unavailable: %s\n", e.what());
  }
  return out;
}

nlohmann::json TopKernels(const std::map<std::string, KernelTime>& kernels, size_t top) {
  std::vector<std::pair<std::string, KernelTime>> v(kernels.begin(), kernels.end());
  double total = 0.0;
  for (const auto& [n, k] : v) total += k.us;
  std::sort(v.begin(), v.end(),
            [](const auto& a, const auto& b) { return a.second.us > b.second.us; });
  nlohmann::json j = nlohmann::json::array();
  for (size_t i = 0; i < v.size() && i < top; ++i)
    j.push_back({{"kernel", v[i].first.substr(0, 120)},
                 {"us", std::round(v[i].second.us * 10) / 10},
                 {"count", v[i].second.count},
                 {"share", std::round(v[i].second.us / total * 1000) / 1000}});
  j.push_back({{"kernel", "(all kernels)"}, {"us", std::round(total * 10) / 10}});
  return j;
}

// Selects one scaled-dot-product-attention backend ("default" leaves LibTorch's choice); false
// where this LibTorch cannot select it.
bool SelectAttention(const std::string& name) {
#if TORCH_VERSION_MAJOR >= 2
  auto& ctx = at::globalContext();
  const bool all = name == "default";
  ctx.setSDPUseFlash(all || name == "flash");
  ctx.setSDPUseMemEfficient(all || name == "efficient");
  ctx.setSDPUseMath(all);
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 3
  ctx.setSDPUseCuDNN(all || name == "cudnn");
#else
  if (name == "cudnn") return false;
#endif
  return true;
#else
  return name == "default";
#endif
}

// The CUDA device when the job asks for one (or "auto" finds one), else a CPU device. `pinned` is
// the host region the CUDA backend pins (this tool moves nothing through it).
rp::StatusOr<std::unique_ptr<rp::worker::Device>> OpenDevice(const rp::core::JobConfig& cfg,
                                                             std::vector<char>* pinned) {
  const bool want_cuda =
      cfg.job.device == rp::core::DeviceKind::kCuda ||
      (cfg.job.device == rp::core::DeviceKind::kAuto && rp::worker::CudaDeviceCount() > 0);
  if (!want_cuda) return rp::worker::MakeCpuDevice();
  return rp::worker::MakeCudaDevice(0, pinned->data(), pinned->size());
}

// One measured part of a microbatch's work; `flops` 0 when it is not counted.
struct Phase {
  std::string name;
  double flops;
  std::function<void()> run;
};

// Times every phase (two warm-up runs, then `reps` timed ones) into `line`, with the block's
// total per microbatch; false, with the error in `line`, when a phase throws.
bool TimePhases(const std::vector<Phase>& phases, int reps, bool profile, bool cuda,
                double block_fwd, rp::worker::Device& device, nlohmann::json* line) {
  try {
    for (const auto& ph : phases) {
      ph.run();  // warm-up: allocator, kernel selection, RoPE tables
      ph.run();
      const int a = device.Mark();
      for (int r = 0; r < reps; ++r) ph.run();
      const double s = device.MarkSeconds(a, device.Mark()) / reps;
      nlohmann::json j = {{"ms", std::round(s * 1e6) / 1e3}};
      if (ph.flops > 0) j["tflops"] = std::round(ph.flops / s / 1e10) / 100;
      device.ClearMarks();
      if (profile) j["kernels"] = TopKernels(ProfileKernels(ph.run, cuda, device), 14);
      device.ClearMarks();
      (*line)[ph.name] = j;
    }
    // Per microbatch as a worker spends it: forward stage, then recompute + backward, fold.
    const double block_ms = (*line)["block_forward"]["ms"].get<double>() +
                            (*line)["block_recompute_backward"]["ms"].get<double>() +
                            (*line)["block_grad_accumulate"]["ms"].get<double>();
    (*line)["block_total_ms"] = std::round(block_ms * 1000) / 1000;
    (*line)["block_total_tflops"] = std::round(4.0 * block_fwd / (block_ms / 1e3) / 1e10) / 100;
    return true;
  } catch (const std::exception& e) {
    (*line)["error"] = std::string(e.what()).substr(0, 400);
    return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string job_path;
  std::vector<std::string> overrides;
  int reps = 10;
  bool profile = false;
  std::string attention = "default";
  CLI::App app{"Device time of one decoder block and the LM head at a job's microbatch shape"};
  app.add_option("job", job_path, "job file (.toml)")->required();
  app.add_option("--set", overrides, "override section.key=value");
  app.add_option("--reps", reps, "timed repetitions per phase")->check(CLI::Range(1, 10000));
  app.add_flag("--profile", profile, "list the kernels that took the most device time per phase");
  bool no_sinks = false;
  app.add_flag(
      "--no-weight-grad-sinks", no_sinks,
      "fold bf16 weight gradients as the worker did before its sinks (for a same-run comparison)");
  app.add_option("--attention", attention, "comma-separated attention backends to try");
  CLI11_PARSE(app, argc, argv);

  auto cfg_or = rp::core::LoadJobConfig(job_path, overrides);
  if (!cfg_or.ok()) {
    std::fprintf(stderr, "rp-block-bench: %s\n", cfg_or.status().message().c_str());
    return rp::kExitBadConfig;
  }
  const rp::core::JobConfig cfg = *cfg_or;
  const rp::core::ModelSpec spec = rp::core::BuildModelSpec(cfg.model, cfg.lora);

  // The CUDA backend pins a host region; this tool moves nothing through it.
  std::vector<char> unused(1 << 20);
  auto opened = OpenDevice(cfg, &unused);
  if (!opened.ok()) {
    std::fprintf(stderr, "rp-block-bench: %s\n", opened.status().message().c_str());
    return rp::kExitCudaError;
  }
  std::unique_ptr<rp::worker::Device> device = std::move(*opened);
  const bool cuda = device->torch_device().is_cuda();
  const bool bf16 = cfg.train.dtype == rp::core::TrainDtype::kBf16 || rp::core::Fp8Matmuls(cfg);
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
  if (rp::core::Fp8Matmuls(cfg) &&
      (device->fused_kernels() == nullptr || !device->fused_kernels()->E4m3MatmulSupported())) {
    std::fprintf(stderr,
                 "rp-block-bench: train.dtype = \"fp8\": %s runs no row-scaled e4m3 products\n",
                 device->Describe().c_str());
    return rp::kExitBadConfig;
  }
  const auto opts = at::TensorOptions().device(device->torch_device()).dtype(dtype);
  at::manual_seed(1);

  rp::model::Transformer math(cfg.model, cfg.train.loss_chunk_tokens, cfg.lora);
  if (cfg.bench.fused_kernels) math.UseFusedKernels(device->fused_kernels());
  math.UseFusedNorms(cfg.bench.fused_norms);
  math.UseE4m3Projections(rp::core::Fp8Matmuls(cfg));
  const int head_layer = spec.NumLayers() - 1;
  LayerWeights block = MakeWeights(spec, 1, opts);
  LayerWeights head = MakeWeights(spec, head_layer, opts);
  const int64_t B = cfg.train.microbatch_size, S = cfg.data.seq_len, H = cfg.model.hidden_size;
  const at::Tensor x = at::randn({B, S, H}, opts);
  const at::Tensor grad_y = at::randn({B, S, H}, opts).mul_(1e-3);
  const at::Tensor labels =
      at::randint(cfg.model.vocab_size, {B, S},
                  at::TensorOptions().device(device->torch_device()).dtype(at::kLong));
  std::map<std::string, at::Tensor> accum;
  for (const auto& [role, t] : block)
    accum[role] = at::zeros(t.sizes(), t.options().dtype(at::kFloat));
  // As the worker does (executor.cc): with the device's fused kernels the projections and the
  // LM head add their gradients into fp32 sums inside the backward GEMM; the fold below then
  // covers only the other weights (the norms).
  const bool sinks = !no_sinks && cfg.bench.fused_kernels && device->fused_kernels() != nullptr;
  if (sinks) {
    rp::model::Transformer::WeightGradSinks s;
    for (const auto& [role, t] : block)
      if (rp::model::Transformer::SinkableRole(role))
        s.emplace(t.unsafeGetTensorImpl(), accum[role]);
    for (const auto& [role, t] : head)
      if (rp::model::Transformer::SinkableRole(role))
        s.emplace(t.unsafeGetTensorImpl(), at::zeros(t.sizes(), t.options().dtype(at::kFloat)));
    math.SetWeightGradSinks(std::move(s));
  }

  // FLOPs per microbatch (multiply-add = 2): the block's projections, and causal attention's two
  // products over half the score matrix; backward is twice the forward.
  const double tokens = static_cast<double>(B * S);
  double proj = 0.0;
  for (const auto& [role, t] : block)
    if (t.dim() == 2) proj += static_cast<double>(t.numel());
  const double attn =
      2.0 * 2.0 * B * static_cast<double>(S) * S / 2.0 * cfg.model.num_heads * cfg.model.head_dim;
  const double block_fwd = 2.0 * tokens * proj + attn;
  const double head_fb = 3.0 * 2.0 * tokens * static_cast<double>(cfg.model.vocab_size) * H;

  std::vector<Phase> phases = {
      {"block_forward", block_fwd,
       [&] {
         c10::NoGradGuard no_grad;
         math.Block(block, x, 1);
       }},
      {"block_recompute_backward", 3.0 * block_fwd,
       [&] {
         at::Tensor in = x.detach().requires_grad_(true);
         math.Block(block, in, 1).backward(grad_y);
         ResetGrads(block);
       }},
      {"block_grad_accumulate", 0.0,
       [&] {
         // The executor's per-microbatch fold of bf16 gradients into fp32 accumulators.
         for (auto& [role, a] : accum)
           if (!sinks || !rp::model::Transformer::SinkableRole(role))
             a.add_(block.at(role).detach());
       }},
      {"head_forward_backward", head_fb,
       [&] {
         at::Tensor in = x.detach().requires_grad_(true);
         math.HeadForwardBackward(head, in, labels, 1.0 / (B * S), /*backward=*/true);
         ResetGrads(head);
       }},
  };

  std::vector<std::string> backends;
  for (size_t p = 0; p <= attention.size();) {
    size_t q = attention.find(',', p);
    if (q == std::string::npos) q = attention.size();
    if (q > p) backends.push_back(attention.substr(p, q - p));
    p = q + 1;
  }
  int failures = 0;
  for (const auto& backend : backends) {
    nlohmann::json line = {{"tool", "rp-block-bench"},
                           {"job", job_path},
                           {"overrides", overrides},
                           {"device", device->Describe()},
                           {"dtype", rp::core::EnumName(cfg.train.dtype)},
                           {"microbatch", {B, S}},
                           {"fused_kernels", cfg.bench.fused_kernels},
                           {"fused_norms", cfg.bench.fused_norms},
                           {"attention", backend},
                           {"torch", TORCH_VERSION},
                           {"reps", reps},
                           {"weight_grad_sinks", sinks}};
    if (!SelectAttention(backend)) {
      line["error"] = "this LibTorch cannot select that attention backend";
      std::printf("%s\n", line.dump().c_str());
      ++failures;
      continue;
    }
    if (!TimePhases(phases, reps, profile, cuda, block_fwd, *device, &line)) ++failures;
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
  return failures == static_cast<int>(backends.size()) ? 1 : 0;
}
