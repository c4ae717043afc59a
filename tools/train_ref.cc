// SPDX-License-Identifier: Apache-2.0
// rp-train-ref job.toml [--set section.key=value ...]
//
// The oracle: the same training as rp-launch in one process, with no pipeline, no shared memory
// and no recompute. It uses the same model math (model/), data order (io/data), init
// (config/model_spec) and optimizer (coordinator/optim), and writes the same metrics.jsonl, so a
// pipelined fp32 CPU run must match it step for step. It loads (model.path) and exports
// (checkpoint.export_hf) Hugging Face directories like rp-launch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include "common/exit_codes.h"
#include "common/exit_status.h"
#include "common/logging.h"
#include "common/test_hooks.h"
#include "optim/optimizer_step.h"
#include "io/data.h"
#include "config/job_config.h"
#include "config/lr_schedule.h"
#include "io/hf_model.h"
#include "config/model_spec.h"
#include "io/peft.h"
#include "io/run_output.h"
#include "model/transformer.h"

namespace {

rp::Status Train(const std::string& job, const std::vector<std::string>& overrides) {
  RP_ASSIGN_OR_RETURN(rp::core::JobConfig cfg, rp::core::LoadJobConfig(job, overrides));
  RP_RETURN_IF_ERROR(rp::core::ResolveTrainingLength(&cfg));
  if (cfg.train.dtype != rp::core::TrainDtype::kFp32)
    return rp::Status::InvalidArgument("train.dtype: rp-train-ref runs fp32 only");
  RP_ASSIGN_OR_RETURN(rp::core::Dataset data, rp::core::Dataset::Open(cfg));
  if (const std::string packing = data.PackingSummary(); !packing.empty()) RP_LOG(INFO) << packing;
  if (const std::string length = data.LengthSummary(); !length.empty()) RP_LOG(INFO) << length;
  std::optional<rp::core::Dataset> eval_data;
  if (cfg.train.eval_every > 0) {
    RP_ASSIGN_OR_RETURN(auto e, rp::core::Dataset::OpenEval(cfg));
    eval_data.emplace(std::move(e));
  }
  RP_RETURN_IF_ERROR(rp::core::PrepareOutputDir(cfg));
  RP_ASSIGN_OR_RETURN(auto metrics,
                      rp::core::MetricsWriter::Open(cfg.job.output_dir + "/metrics.jsonl"));
  const rp::core::ModelSpec spec = rp::core::BuildModelSpec(cfg.model, cfg.lora);
  rp::model::Transformer math(cfg.model, cfg.train.loss_chunk_tokens, cfg.lora);

  // `params` are what the model computes with; `masters` are what the optimizer updates. In
  // exact mode they are the same tensors. In stale1 mode step t computes with the weights
  // holding t - 1 updates, so `params` trail `masters` by one update.
  const bool stale1 = cfg.optimizer.mode == rp::core::OptimizerMode::kStale1;
  std::vector<at::Tensor> params, masters, adam_m, adam_v;
  std::optional<rp::core::HfWeights> hf;
  if (!cfg.model.path.empty()) {
    RP_ASSIGN_OR_RETURN(auto w, rp::core::HfWeights::Open(cfg.model.path));
    hf.emplace(std::move(w));
  }
  // LoRA: the base is frozen (no gradient), from the checkpoint or the seeded init; the adapters
  // start from lora.init_from or their own init.
  std::vector<at::Tensor> frozen;
  for (const auto& ps : spec.frozen) {
    at::Tensor t = at::empty(ps.shape, at::kFloat);
    if (hf) RP_RETURN_IF_ERROR(hf->Load(ps, t.data_ptr<float>()));
    else
      rp::core::InitParam(ps, spec.config, static_cast<uint64_t>(cfg.train.seed),
                          t.data_ptr<float>());
    frozen.push_back(t);
  }
  std::optional<rp::core::PeftAdapter> adapter;
  if (spec.lora.enabled()) {
    hf.reset();
    if (!cfg.lora.init_from.empty()) {
      RP_ASSIGN_OR_RETURN(auto a, rp::core::PeftAdapter::Open(cfg.lora.init_from, spec));
      adapter.emplace(std::move(a));
    }
  }
  for (size_t p = 0; p < spec.params.size(); ++p) {
    at::Tensor t = at::empty(spec.params[p].shape, at::kFloat);
    if (adapter) RP_RETURN_IF_ERROR(adapter->Load(spec.params[p], t.data_ptr<float>()));
    else if (hf) RP_RETURN_IF_ERROR(hf->Load(spec.params[p], t.data_ptr<float>()));
    else
      rp::core::InitParam(spec, static_cast<int>(p), static_cast<uint64_t>(cfg.train.seed),
                          t.data_ptr<float>());
    masters.push_back(stale1 ? t.clone() : t);
    params.push_back(t.requires_grad_(true));
    adam_m.push_back(at::zeros_like(t));
    adam_v.push_back(at::zeros_like(t));
  }
  std::vector<rp::model::LayerWeights> layers(spec.NumLayers());
  for (int l = 0; l < spec.NumLayers(); ++l) {
    for (auto& use : spec.layer_uses[l]) layers[l].emplace(use.role, params[use.param]);
    for (auto& use : spec.layer_frozen[l]) layers[l].emplace(use.role, frozen[use.param]);
  }

  const int64_t B = cfg.train.microbatch_size, S = cfg.data.seq_len;
  at::Tensor tokens = at::empty({B, S}, at::kLong), labels = at::empty({B, S}, at::kLong);
  at::Tensor positions = at::empty({B, S}, at::kLong);
  auto set_documents = [&] {
    math.SetDocuments(rp::model::MakeDocuments(
        positions.data_ptr<int64_t>(), B, S, [](const int64_t* host, int64_t n) {
          return at::from_blob(const_cast<int64_t*>(host), {n}, at::kLong).clone();
        }));
  };
  const int L = static_cast<int>(cfg.model.num_layers);
  for (int64_t step = 0; step < cfg.train.steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    const double scale = 1.0 / static_cast<double>(data.CountStepTargets(step));
    double loss_sum = 0.0;
    int64_t targets = 0;
    for (int64_t c = 0; c < rp::core::Round(cfg).calls; ++c)
      for (int64_t mb = 0; mb < rp::core::Round(cfg).microbatches; ++mb) {
        data.Fill(step, c, mb, tokens.data_ptr<int64_t>(), labels.data_ptr<int64_t>(),
                  positions.data_ptr<int64_t>());
        set_documents();
        math.SetDropoutKey(rp::model::DropoutKey(cfg.train.seed, step,
                                                 c * rp::core::Round(cfg).microbatches + mb));
        // The routers' load-balancing loss: its gradient, set before the forward, is filled
        // once every sparse block has routed, before the backward reads it.
        at::Tensor aux_grad;
        if (cfg.model.moe.aux_loss_weight > 0.0) {
          aux_grad = at::zeros({cfg.model.moe.num_experts}, at::kFloat);
          math.SetRouterAuxGrad(aux_grad);
        }
        at::Tensor x = math.Embed(layers[0], tokens);
        for (int l = 1; l <= L; ++l) x = math.Block(layers[l], x, l);
        double aux_loss_sum = 0.0;
        if (aux_grad.defined()) {
          const rp::model::RouterAux aux =
              math.WholeModelRouterAux(B * S, rp::core::RouterAuxWeight(cfg));
          aux_grad.copy_(at::tensor(aux.grad, at::kFloat));
          aux_loss_sum = aux.value / scale;
        }
        const double loss_scale = step == rp::TestNanStep() ? std::nan("") : scale;
        auto r = math.HeadForwardBackward(layers[L + 1], x, labels, loss_scale, /*backward=*/true);
        math.SetRouterAuxGrad({});
        loss_sum += r.loss_sum + aux_loss_sum;
        targets += r.targets;
      }
    if (stale1 && step > 0) {
      // The next step computes with the weights as they are now (step updates applied).
      c10::NoGradGuard no_grad;
      for (size_t p = 0; p < params.size(); ++p) params[p].copy_(masters[p]);
    }
    std::vector<rp::coord::ParamArrays> arrays;
    for (size_t p = 0; p < params.size(); ++p) {
      at::Tensor g = params[p].grad();
      if (!g.defined()) return rp::Status::Internal(spec.params[p].name + " received no gradient");
      rp::coord::ParamArrays a;
      a.master = masters[p].data_ptr<float>();
      a.m = adam_m[p].data_ptr<float>();
      a.v = cfg.optimizer.name == rp::core::OptimizerName::kAdamW ? adam_v[p].data_ptr<float>()
                                                                  : nullptr;
      a.grad = g.data_ptr<float>();
      a.compute = a.master;  // the master is its own copy; stale1 copies it into params above
      a.numel = spec.params[p].numel;
      a.decay = spec.params[p].weight_decay;
      a.row_elems = spec.TiedRowElems(static_cast<int>(p));
      arrays.push_back(a);
    }
    const double lr = rp::core::LearningRate(cfg.optimizer, step, cfg.train.steps);
    auto res = rp::coord::OptimizerStep(arrays, cfg.optimizer, lr, step + 1, cfg.train.grad_clip,
                                        rp::coord::ComputeDtype::kFloat32, 1);
    for (auto& p : params) p.mutable_grad().zero_();
    // Eval after this step's update, with the weights holding step + 1 updates (the masters).
    const int64_t every = cfg.train.eval_every;
    double eval_sum = 0.0;
    int64_t eval_targets = 0;
    if (every > 0 && ((step + 1) % every == 0 || step + 1 == cfg.train.steps)) {
      c10::NoGradGuard no_grad;
      math.SetTraining(false);
      std::vector<rp::model::LayerWeights> current(spec.NumLayers());
      for (int l = 0; l < spec.NumLayers(); ++l) {
        for (auto& use : spec.layer_uses[l]) current[l].emplace(use.role, masters[use.param]);
        for (auto& use : spec.layer_frozen[l]) current[l].emplace(use.role, frozen[use.param]);
      }
      for (int64_t k = 0; k < cfg.train.eval_microbatches; ++k) {
        eval_data->FillEval(k, tokens.data_ptr<int64_t>(), labels.data_ptr<int64_t>(),
                            positions.data_ptr<int64_t>());
        set_documents();
        at::Tensor x = math.Embed(current[0], tokens);
        for (int l = 1; l <= L; ++l) x = math.Block(current[l], x, l);
        auto r = math.HeadForwardBackward(current[L + 1], x, labels, 1.0, /*backward=*/false);
        eval_sum += r.loss_sum;
        eval_targets += r.targets;
      }
      math.SetTraining(true);
      if (eval_targets == 0)
        return rp::Status::InvalidArgument("data: the eval set has no target tokens");
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rp::core::StepMetrics m;
    m.step = step + 1;
    m.loss = loss_sum / static_cast<double>(targets);
    m.lr = lr;
    m.grad_norm = res.grad_norm;
    m.tokens = rp::core::Round(cfg).calls * rp::core::Round(cfg).microbatches * B * S;
    m.step_time_s = secs;
    if (eval_targets > 0) {
      m.eval_loss = eval_sum / static_cast<double>(eval_targets);
      m.eval_tokens = eval_targets;
    }
    if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm))
      return rp::Status::NonFinite("step " + std::to_string(step + 1) + ": the gradient norm is " +
                                   std::to_string(m.grad_norm) +
                                   " (not finite): training diverged");
    RP_RETURN_IF_ERROR(metrics.Append(m));
    RP_LOG(INFO) << "step " << m.step << " loss " << m.loss << " grad_norm " << m.grad_norm
                 << (m.eval_loss >= 0 ? " eval_loss " + std::to_string(m.eval_loss)
                                      : std::string());
  }
  // The same exports as the coordinator's.
  RP_RETURN_IF_ERROR(rp::core::ExportTrainedModel(
      cfg, spec, [&](int p) { return masters[p].data_ptr<float>(); },
      [&](int f, float* out) {
        std::memcpy(out, frozen[f].data_ptr<float>(), frozen[f].numel() * sizeof(float));
      }));
  return rp::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  std::string job;
  std::vector<std::string> overrides;
  CLI::App app{"RoundPipe single-process reference trainer (the oracle)"};
  app.add_option("job", job, "job file (TOML)")->required();
  app.add_option("--set", overrides, "override a job key: section.key=value (repeatable)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : rp::kExitBadConfig;
  }
  rp::InitLogging(argv[0], "ref");
  at::set_num_threads(1);  // same intra-op threading as a worker, for bitwise-comparable math
  rp::Status s = Train(job, overrides);
  if (!s.ok()) {
    std::fprintf(stderr, "rp-train-ref: %s\n", s.ToString().c_str());
    return rp::ExitCodeFor(s);
  }
  return 0;
}
