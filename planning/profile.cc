// SPDX-License-Identifier: Apache-2.0
#include "planning/profile.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "io/run_output.h"

namespace rp::core {
double Median(std::vector<double> v) {
  if (v.empty()) return -1.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {

// Forward FLOPs of one microbatch through pipeline layer l (embedding: none worth counting):
// the matrix products with weights, and the attention core's, apart (their backward differs).
struct LayerFlops {
  double dense = 0.0;
  double attention = 0.0;
  double tiled_mlp = 0.0;  // of `dense`, a tiled MLP's (train.mlp_tile_tokens), run again backwards
};
LayerFlops ForwardFlops(const JobConfig& c, int l) {
  const auto& m = c.model;
  const double tokens = static_cast<double>(c.TokensPerMicrobatch());
  const double seq = static_cast<double>(c.data.seq_len);
  const int L = static_cast<int>(m.num_layers);
  if (l == 0) return {};
  if (l == L + 1) return {2.0 * static_cast<double>(m.vocab_size * m.hidden_size) * tokens, 0.0};
  // A sparse block's MLP: the router and the k experts each token runs through.
  const int64_t mlp = SparseBlock(m, l - 1) ? m.hidden_size * m.moe.num_experts +
                                                  m.moe.experts_per_token * 3 * m.hidden_size *
                                                      m.moe.expert_intermediate_size
                                            : 3 * m.hidden_size * m.intermediate_size;
  const double block_params =
      static_cast<double>(m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim +
                          m.num_heads * m.head_dim * m.hidden_size + mlp);
  // A sparse block is never tiled.
  const bool tiled = !SparseBlock(m, l - 1) && c.train.mlp_tile_tokens > 0 &&
                     static_cast<double>(c.train.mlp_tile_tokens) < tokens;
  // Causal attention: QK^T and PV over half the square.
  return {2.0 * block_params * tokens,
          2.0 * tokens * seq * static_cast<double>(m.num_heads * m.head_dim),
          tiled ? 2.0 * static_cast<double>(mlp) * tokens : 0.0};
}

}  // namespace

double ReplayedRecompute(const JobConfig& c, const LayerCost& cost, int layer) {
  if (layer < 1 || layer > c.model.num_layers) return cost.recompute_s;
  const LayerFlops f = ForwardFlops(c, layer);
  const double total = f.dense + f.attention;
  return total > 0 ? cost.recompute_s * f.dense / total : cost.recompute_s;
}

std::vector<double> Profile::ForwardCosts() const {
  std::vector<double> out;
  for (const auto& l : layers) out.push_back(l.forward_s);
  return out;
}

std::vector<double> Profile::BackwardCosts() const {
  std::vector<double> out;
  for (const auto& l : layers) out.push_back(l.recompute_s + l.backward_s);
  return out;
}

std::string WorkloadKey(const JobConfig& c) {
  const auto& m = c.model;
  std::ostringstream s;
  s << "L" << m.num_layers << "-h" << m.hidden_size << "-i" << m.intermediate_size << "-a"
    << m.num_heads << "x" << m.head_dim << "-kv" << m.num_kv_heads << "-v" << m.vocab_size
    << (m.tie_embeddings ? "-tied" : "");
  if (m.moe.num_experts > 0) {
    s << "-e" << m.moe.num_experts << "k" << m.moe.experts_per_token << "i"
      << m.moe.expert_intermediate_size << "s" << m.moe.sparse_step;
    for (auto d : m.moe.dense_layers) s << "d" << d;
  }
  s << "/mb" << c.train.microbatch_size << "x" << c.data.seq_len << "/" << EnumName(c.train.dtype)
    << "/" << (c.job.device == core::DeviceKind::kCpu ? "cpu" : "cuda");
  return s.str();
}

Profile CostModelProfile(const JobConfig& c, double flops_per_s, double link_bytes_per_s,
                         double optimizer_params_per_s) {
  Profile p;
  p.source = "cost-model";
  p.workload = WorkloadKey(c);
  const int layers = static_cast<int>(c.model.num_layers) + 2;
  // A product with a weight costs twice its forward backwards (the input's gradient and the
  // weight's). The GPU's fused attention backward also recomputes the scores it did not keep:
  // five products of the core's size to the forward's two. The CPU's explicit attention keeps
  // its probabilities: four. At long sequences the core is most of a block's FLOPs, and counting
  // it at 2x left 256K-token steps over a tenth longer than predicted.
  const double attention_backward = c.job.device == core::DeviceKind::kCpu ? 2.0 : 2.5;
  for (int l = 0; l < layers; ++l) {
    LayerCost lc;
    const LayerFlops flops = ForwardFlops(c, l);
    const double f = (flops.dense + flops.attention) / flops_per_s;
    lc.forward_s = lc.recompute_s = f;
    // A tiled MLP keeps only its tiles' input and runs each tile forward again in the backward.
    lc.backward_s =
        (2.0 * flops.dense + attention_backward * flops.attention + flops.tiled_mlp) / flops_per_s;
    if (l == layers - 1) {  // the head runs forward and backward together
      lc.recompute_s = 3.0 * f;
      lc.backward_s = 0.0;
    }
    p.layers.push_back(lc);
  }
  p.h2d_bytes_per_s = p.d2h_bytes_per_s = link_bytes_per_s;
  p.optimizer_params_per_s = optimizer_params_per_s;
  return p;
}

DeviceModel H200Model() {
  DeviceModel d;
  d.name = "h200";
  d.bf16_flops_per_s = 790e12;
  d.fp32_flops_per_s = 67e12;
  d.link_bytes_per_s = 55e9;
  d.optimizer_params_per_s = 6.7e9;
  d.memory_gb = 141.0;
  d.source =
      "one H200: bf16 products at the 790 TFLOP/s its kernels reach, fp32 67 TFLOP/s, host link 55 "
      "GB/s "
      "measured, AdamW 6.7e9 parameters/s on 16 cores";
  return d;
}

DeviceModel H100Model() {
  // The H100 SXM's datasheet matches the H200's in dense bf16 and fp32: the H200 differs in
  // memory size and bandwidth, which this model does not time. So the products run at the H200's
  // rates; the host link is the H100 host's own probe. The figures are in `source` below.
  DeviceModel d = H200Model();
  d.name = "h100";
  d.link_bytes_per_s = 53.9e9;
  d.memory_gb = 80.0;
  d.source =
      "one H100 SXM: its datasheet's dense bf16 and fp32 rates equal the H200's, so bf16 products "
      "at the "
      "790 TFLOP/s the H200's kernels reach, fp32 67 TFLOP/s, host link 53.9 GB/s (its link "
      "probe), AdamW "
      "6.7e9 parameters/s on 16 cores";
  return d;
}

StatusOr<DeviceModel> DeviceModelNamed(const std::string& name) {
  if (name == "h200") return H200Model();
  if (name == "h100") return H100Model();
  return Status::InvalidArgument("--device: \"" + name +
                                 "\" is not a device the cost model knows (h200, h100, or "
                                 "custom with --tflops and --h2d-gbs)");
}

Profile DefaultCostModel(const JobConfig& c, const DeviceModel& device) {
  // CPU workers: a few tens of GFLOP/s each, copies at memory speed. GPU: 70% of the device's
  // peak for the dtype, the share its kernels reached per layer at the Qwen3-1.7B job's shapes
  // in a stored profile (bench/profiles/qwen3-1.7b-h200-mb4-host-lookup.json; fp32, which runs
  // without tensor cores, is assumed to reach the same share, unmeasured), the host links and
  // the coordinator's AdamW at the device model's rates. docs/benchmarks.md ("Measurements
  // behind the code's choices") has the per-layer shares and what a lower share predicted.
  if (c.job.device == core::DeviceKind::kCpu) return CostModelProfile(c, 2e10, 0.0, 0.0);
  // fp16 and fp8: bf16's tensor-core peak. fp8's faster products are not modelled here; a run's
  // measured profile (schedule.profile_steps) times them as they run.
  const double peak =
      c.train.dtype == core::TrainDtype::kFp32 ? device.fp32_flops_per_s : device.bf16_flops_per_s;
  Profile p =
      CostModelProfile(c, 0.7 * peak, device.link_bytes_per_s, device.optimizer_params_per_s);
  p.optimizer_pass_bytes = device.optimizer_pass_bytes;
  return p;
}

std::string ProfileToJson(const Profile& p) {
  nlohmann::json layers = nlohmann::json::array();
  for (size_t l = 0; l < p.layers.size(); ++l) {
    const auto& c = p.layers[l];
    layers.push_back({{"layer", l},
                      {"forward_s", c.forward_s},
                      {"recompute_s", c.recompute_s},
                      {"backward_s", c.backward_s},
                      {"saved_bytes", c.saved_bytes},
                      {"samples", c.samples},
                      {"filled", c.filled}});
  }
  nlohmann::json j = {{"format_version", kProfileFormatVersion},
                      {"source", p.source},
                      {"workload", p.workload},
                      {"h2d_bytes_per_s", p.h2d_bytes_per_s},
                      {"d2h_bytes_per_s", p.d2h_bytes_per_s},
                      {"optimizer_params_per_s", p.optimizer_params_per_s},
                      {"optimizer_pass_bytes", p.optimizer_pass_bytes},
                      {"microbatch_overhead_s", p.microbatch_overhead_s},
                      {"profiled_steps", p.profiled_steps},
                      {"layers", layers}};
  return j.dump(1);
}

Status SaveProfile(const std::string& path, const Profile& p) {
  return WriteFileAtomically(path, ProfileToJson(p) + "\n");
}

StatusOr<Profile> LoadProfile(const std::string& path, const JobConfig& c) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("profile " + path + ": cannot open");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    return Status::InvalidArgument("profile " + path + ": not JSON (" + e.what() + ")");
  }
  auto bad = [&](const std::string& what) {
    return Status::InvalidArgument("profile " + path + ": " + what);
  };
  auto number = [&](const nlohmann::json& o, const char* key, double* out) -> Status {
    if (!o.contains(key) || !o[key].is_number())
      return bad(std::string("\"") + key + "\" is missing or not a number");
    *out = o[key].get<double>();
    if (!std::isfinite(*out)) return bad(std::string("\"") + key + "\" is not finite");
    return Status::Ok();
  };
  if (!j.is_object()) return bad("not a JSON object");
  if (!j.contains("format_version") || j["format_version"] != kProfileFormatVersion)
    return bad("format_version is not " + std::to_string(kProfileFormatVersion));
  Profile p;
  if (!j.contains("workload") || !j["workload"].is_string()) return bad("\"workload\" is missing");
  p.workload = j["workload"].get<std::string>();
  if (p.workload != WorkloadKey(c))
    return bad("measured for workload " + p.workload + ", this job is " + WorkloadKey(c));
  p.source = j.value("source", std::string("measured"));
  RP_RETURN_IF_ERROR(number(j, "h2d_bytes_per_s", &p.h2d_bytes_per_s));
  RP_RETURN_IF_ERROR(number(j, "d2h_bytes_per_s", &p.d2h_bytes_per_s));
  RP_RETURN_IF_ERROR(number(j, "optimizer_params_per_s", &p.optimizer_params_per_s));
  RP_RETURN_IF_ERROR(number(j, "microbatch_overhead_s", &p.microbatch_overhead_s));
  // Written since the update passes became a choice; older profiles leave it 0 (not recorded).
  if (j.contains("optimizer_pass_bytes"))
    RP_RETURN_IF_ERROR(number(j, "optimizer_pass_bytes", &p.optimizer_pass_bytes));
  if (p.h2d_bytes_per_s < 0 || p.d2h_bytes_per_s < 0 || p.optimizer_params_per_s < 0 ||
      p.optimizer_pass_bytes < 0 || p.microbatch_overhead_s < 0)
    return bad("rates and overheads must be >= 0");
  p.profiled_steps = j.value("profiled_steps", 0);
  const size_t want = static_cast<size_t>(c.model.num_layers + 2);
  if (!j.contains("layers") || !j["layers"].is_array() || j["layers"].size() != want)
    return bad("\"layers\" must list " + std::to_string(want) + " pipeline layers");
  for (size_t l = 0; l < want; ++l) {
    const auto& o = j["layers"][l];
    if (!o.is_object()) return bad("layers[" + std::to_string(l) + "] is not an object");
    LayerCost lc;
    RP_RETURN_IF_ERROR(number(o, "forward_s", &lc.forward_s));
    RP_RETURN_IF_ERROR(number(o, "recompute_s", &lc.recompute_s));
    RP_RETURN_IF_ERROR(number(o, "backward_s", &lc.backward_s));
    RP_RETURN_IF_ERROR(number(o, "saved_bytes", &lc.saved_bytes));
    if (lc.forward_s < 0 || lc.recompute_s < 0 || lc.backward_s < 0)
      return bad("layers[" + std::to_string(l) + "] has a negative time");
    lc.samples = o.value("samples", 0);
    lc.filled = o.value("filled", false);
    p.layers.push_back(lc);
  }
  return p;
}

void ProfileBuilder::AddLayer(int layer, int phase, double seconds, double saved_bytes) {
  if (layer < 0 || layer >= static_cast<int>(samples_.size()) || phase < 0 || phase > 2) return;
  samples_[layer].phase[phase].push_back(seconds);
  if (saved_bytes >= 0 && phase == 1) samples_[layer].bytes.push_back(saved_bytes);
}

void ProfileBuilder::AddLink(double h2d, double d2h) {
  if (h2d > 0) h2d_.push_back(h2d);
  if (d2h > 0) d2h_.push_back(d2h);
}

double ProfileBuilder::H2dBytesPerS() const { return h2d_.empty() ? 0.0 : Median(h2d_); }
double ProfileBuilder::D2hBytesPerS() const { return d2h_.empty() ? 0.0 : Median(d2h_); }

void ProfileBuilder::AddMicrobatch(double interval_s, double explained_s) {
  overhead_.push_back(std::max(0.0, interval_s - explained_s));
}

void ProfileBuilder::AddOptimizer(double params, double busy_s, double pass_bytes) {
  opt_params_ += params;
  opt_busy_s_ += busy_s;
  opt_pass_bytes_ = pass_bytes;
}

void ProfileBuilder::Clear() {
  for (auto& s : samples_) s = LayerSamples();
  overhead_.clear();
  opt_params_ = opt_busy_s_ = opt_pass_bytes_ = 0.0;
  steps_ = 0;
}

StatusOr<Profile> ProfileBuilder::Build(const JobConfig& c) const {
  Profile p;
  p.source = "measured";
  p.workload = WorkloadKey(c);
  p.profiled_steps = steps_;
  const int n = static_cast<int>(samples_.size());
  const int head = n - 1;
  // Ratios over the layers where both phases were measured, to fill a missing phase.
  std::vector<double> fwd_over_rec, bwd_over_rec;
  for (int l = 0; l < n; ++l) {
    const auto& s = samples_[l];
    LayerCost lc;
    lc.forward_s = Median(s.phase[0]);
    lc.recompute_s = Median(s.phase[1]);
    lc.backward_s = l == head ? 0.0 : Median(s.phase[2]);
    lc.saved_bytes = Median(s.bytes);
    lc.samples = static_cast<int>(s.phase[0].size() + s.phase[1].size() + s.phase[2].size());
    if (l > 0 && l < head && lc.forward_s > 0 && lc.recompute_s > 0)
      fwd_over_rec.push_back(lc.forward_s / lc.recompute_s);
    if (l > 0 && l < head && lc.backward_s > 0 && lc.recompute_s > 0)
      bwd_over_rec.push_back(lc.backward_s / lc.recompute_s);
    p.layers.push_back(lc);
  }
  const double f_ratio = fwd_over_rec.empty() ? 1.0 : Median(fwd_over_rec);
  const double b_ratio = bwd_over_rec.empty() ? 2.0 : Median(bwd_over_rec);
  for (int l = 0; l < n; ++l) {
    LayerCost& lc = p.layers[l];
    if (lc.recompute_s < 0 && lc.forward_s < 0)
      return Status::Internal("profile: layer " + std::to_string(l) + " was never timed");
    if (lc.forward_s < 0) {
      lc.forward_s = l == head ? lc.recompute_s / 3.0 : lc.recompute_s * f_ratio;
      lc.filled = true;
    }
    if (lc.recompute_s < 0) {
      lc.recompute_s = lc.forward_s / f_ratio;
      lc.filled = true;
    }
    if (lc.backward_s < 0) {
      lc.backward_s = lc.recompute_s * b_ratio;
      lc.filled = true;
    }
  }
  p.h2d_bytes_per_s = H2dBytesPerS();
  p.d2h_bytes_per_s = D2hBytesPerS();
  p.optimizer_params_per_s = opt_busy_s_ > 0 ? opt_params_ / opt_busy_s_ : 0.0;
  p.optimizer_pass_bytes = opt_busy_s_ > 0 ? opt_pass_bytes_ : 0.0;
  // The mean, not the median: the occasional long interval (a microbatch that waited for its
  // weights, or for the CPU) is a real cost of every step.
  double overhead_sum = 0.0;
  for (double o : overhead_) overhead_sum += o;
  p.microbatch_overhead_s =
      overhead_.empty() ? 0.0 : overhead_sum / static_cast<double>(overhead_.size());
  return p;
}

}  // namespace rp::core
