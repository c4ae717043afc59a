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
#include <memory>
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

// The whole training in one process: the job's model, data and state, and the parts of a step.
class ReferenceTrainer {
 public:
  static rp::StatusOr<std::unique_ptr<ReferenceTrainer>> Open(
      const std::string& job, const std::vector<std::string>& overrides);
  rp::Status Run();

 private:
  struct Sums {
    double loss = 0.0;
    int64_t targets = 0;
  };

  ReferenceTrainer(rp::core::JobConfig cfg, rp::core::Dataset data, rp::core::MetricsWriter metrics)
      : cfg_(std::move(cfg)),
        data_(std::move(data)),
        metrics_(std::move(metrics)),
        spec_(rp::core::BuildModelSpec(cfg_.model, cfg_.lora)),
        math_(cfg_.model, cfg_.train.loss_chunk_tokens, cfg_.lora),
        stale1_(rp::core::ResolveExecution(cfg_).weight_version_lag > 0) {
    // The pipeline's attention kernels for the job (its records hold the same values).
    math_.UseRecordedAttention(cfg_.schedule.keep_attention != 0);
  }

  rp::Status LoadWeights();
  std::vector<rp::model::LayerWeights> Layers(const std::vector<at::Tensor>& trained) const;
  void SetDocuments();
  // The forward and backward of every microbatch of `step`, gradients summed into params_.
  Sums ComputeStep(int64_t step);
  rp::StatusOr<rp::coord::OptimizerStepResult> Update(int64_t step);
  // The eval set's loss after `step`'s update, when the job evaluates then; zero sums otherwise.
  rp::StatusOr<Sums> Evaluate(int64_t step);

  rp::core::JobConfig cfg_;
  rp::core::Dataset data_;
  std::optional<rp::core::Dataset> eval_data_;
  rp::core::MetricsWriter metrics_;
  const rp::core::ModelSpec spec_;
  rp::model::Transformer math_;
  // `params_` are what the model computes with; `masters_` are what the optimizer updates. In
  // exact mode they are the same tensors. In stale1 mode step t computes with the weights holding
  // t - 1 updates, so `params_` trail `masters_` by one update.
  const bool stale1_;
  std::vector<at::Tensor> params_, masters_, adam_m_, adam_v_, frozen_;
  std::vector<rp::model::LayerWeights> layers_;
  at::Tensor tokens_, labels_, positions_;
};

rp::StatusOr<std::unique_ptr<ReferenceTrainer>> ReferenceTrainer::Open(
    const std::string& job, const std::vector<std::string>& overrides) {
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
  std::unique_ptr<ReferenceTrainer> trainer(
      new ReferenceTrainer(std::move(cfg), std::move(data), std::move(metrics)));
  trainer->eval_data_ = std::move(eval_data);
  RP_RETURN_IF_ERROR(trainer->LoadWeights());
  const int64_t B = trainer->cfg_.train.microbatch_size, S = trainer->cfg_.data.seq_len;
  trainer->tokens_ = at::empty({B, S}, at::kLong);
  trainer->labels_ = at::empty({B, S}, at::kLong);
  trainer->positions_ = at::empty({B, S}, at::kLong);
  return trainer;
}

rp::Status ReferenceTrainer::LoadWeights() {
  std::optional<rp::core::HfWeights> hf;
  if (!cfg_.model.path.empty()) {
    RP_ASSIGN_OR_RETURN(auto w, rp::core::HfWeights::Open(cfg_.model.path));
    hf.emplace(std::move(w));
  }
  // LoRA: the base is frozen (no gradient), from the checkpoint or the seeded init; the adapters
  // start from lora.init_from or their own init.
  const auto seed = static_cast<uint64_t>(cfg_.train.seed);
  for (const auto& ps : spec_.frozen) {
    at::Tensor t = at::empty(ps.shape, at::kFloat);
    if (hf) RP_RETURN_IF_ERROR(hf->Load(ps, t.data_ptr<float>()));
    else rp::core::InitParam(ps, spec_.config, seed, t.data_ptr<float>());
    frozen_.push_back(t);
  }
  std::optional<rp::core::PeftAdapter> adapter;
  if (spec_.lora.enabled()) {
    hf.reset();
    if (!cfg_.lora.init_from.empty()) {
      RP_ASSIGN_OR_RETURN(auto a, rp::core::PeftAdapter::Open(cfg_.lora.init_from, spec_));
      adapter.emplace(std::move(a));
    }
  }
  for (size_t p = 0; p < spec_.params.size(); ++p) {
    at::Tensor t = at::empty(spec_.params[p].shape, at::kFloat);
    if (adapter) RP_RETURN_IF_ERROR(adapter->Load(spec_.params[p], t.data_ptr<float>()));
    else if (hf) RP_RETURN_IF_ERROR(hf->Load(spec_.params[p], t.data_ptr<float>()));
    else rp::core::InitParam(spec_, static_cast<int>(p), seed, t.data_ptr<float>());
    masters_.push_back(stale1_ ? t.clone() : t);
    params_.push_back(t.requires_grad_(true));
    adam_m_.push_back(at::zeros_like(t));
    adam_v_.push_back(at::zeros_like(t));
  }
  layers_ = Layers(params_);
  return rp::Status::Ok();
}

std::vector<rp::model::LayerWeights> ReferenceTrainer::Layers(
    const std::vector<at::Tensor>& trained) const {
  std::vector<rp::model::LayerWeights> layers(spec_.NumLayers());
  for (int l = 0; l < spec_.NumLayers(); ++l) {
    for (auto& use : spec_.layer_uses[l]) layers[l].emplace(use.role, trained[use.param]);
    for (auto& use : spec_.layer_frozen[l]) layers[l].emplace(use.role, frozen_[use.param]);
  }
  return layers;
}

void ReferenceTrainer::SetDocuments() {
  math_.SetDocuments(rp::model::MakeDocuments(
      positions_.data_ptr<int64_t>(), cfg_.train.microbatch_size, cfg_.data.seq_len,
      [](const int64_t* host, int64_t n) {
        return at::from_blob(const_cast<int64_t*>(host), {n}, at::kLong).clone();
      }));
}

ReferenceTrainer::Sums ReferenceTrainer::ComputeStep(int64_t step) {
  const int L = static_cast<int>(cfg_.model.num_layers);
  const int64_t tokens_per_microbatch = cfg_.train.microbatch_size * cfg_.data.seq_len;
  const double scale = 1.0 / static_cast<double>(data_.CountStepTargets(step));
  Sums sums;
  for (int64_t c = 0; c < rp::core::Round(cfg_).calls; ++c)
    for (int64_t mb = 0; mb < rp::core::Round(cfg_).microbatches; ++mb) {
      data_.Fill(step, c, mb, tokens_.data_ptr<int64_t>(), labels_.data_ptr<int64_t>(),
                 positions_.data_ptr<int64_t>());
      SetDocuments();
      math_.SetDropoutKey(rp::model::DropoutKey(cfg_.train.seed, step,
                                                c * rp::core::Round(cfg_).microbatches + mb));
      // The routers' load-balancing loss: its gradient, set before the forward, is filled once
      // every sparse block has routed, before the backward reads it.
      at::Tensor aux_grad;
      if (cfg_.model.moe.aux_loss_weight > 0.0) {
        aux_grad = at::zeros({cfg_.model.moe.num_experts}, at::kFloat);
        math_.SetRouterAuxGrad(aux_grad);
      }
      at::Tensor x = math_.Embed(layers_[0], tokens_);
      for (int l = 1; l <= L; ++l) x = math_.Block(layers_[l], x, l);
      double aux_loss_sum = 0.0;
      if (aux_grad.defined()) {
        const rp::model::RouterAux aux =
            math_.WholeModelRouterAux(tokens_per_microbatch, rp::core::RouterAuxWeight(cfg_));
        aux_grad.copy_(at::tensor(aux.grad, at::kFloat));
        aux_loss_sum = aux.value / scale;
      }
      const double loss_scale = step == rp::TestNanStep() ? std::nan("") : scale;
      auto r = math_.HeadForwardBackward(layers_[L + 1], x, labels_, loss_scale, /*backward=*/true);
      math_.SetRouterAuxGrad({});
      sums.loss += r.loss_sum + aux_loss_sum;
      sums.targets += r.targets;
    }
  return sums;
}

rp::StatusOr<rp::coord::OptimizerStepResult> ReferenceTrainer::Update(int64_t step) {
  if (stale1_ && step > 0) {
    // The next step computes with the weights as they are now (step updates applied).
    c10::NoGradGuard no_grad;
    for (size_t p = 0; p < params_.size(); ++p) params_[p].copy_(masters_[p]);
  }
  std::vector<rp::coord::ParamArrays> arrays;
  for (size_t p = 0; p < params_.size(); ++p) {
    at::Tensor g = params_[p].grad();
    if (!g.defined()) return rp::Status::Internal(spec_.params[p].name + " received no gradient");
    rp::coord::ParamArrays a;
    a.master = masters_[p].data_ptr<float>();
    a.m = adam_m_[p].data_ptr<float>();
    a.v = cfg_.optimizer.name == rp::core::OptimizerName::kAdamW ? adam_v_[p].data_ptr<float>()
                                                                 : nullptr;
    a.grad = g.data_ptr<float>();
    a.compute = a.master;  // the master is its own copy; stale1 copies it into params above
    a.numel = spec_.params[p].numel;
    a.decay = spec_.params[p].weight_decay;
    a.row_elems = spec_.TiedRowElems(static_cast<int>(p));
    arrays.push_back(a);
  }
  const double lr = rp::core::LearningRate(cfg_.optimizer, step, cfg_.train.steps);
  auto res = rp::coord::OptimizerStep(arrays, cfg_.optimizer, lr, step + 1, cfg_.train.grad_clip,
                                      rp::coord::ComputeDtype::kFloat32, 1);
  for (auto& p : params_) p.mutable_grad().zero_();
  return res;
}

// Eval after this step's update, with the weights holding step + 1 updates (the masters).
rp::StatusOr<ReferenceTrainer::Sums> ReferenceTrainer::Evaluate(int64_t step) {
  const int64_t every = cfg_.train.eval_every;
  Sums sums;
  if (!(every > 0 && ((step + 1) % every == 0 || step + 1 == cfg_.train.steps))) return sums;
  const int L = static_cast<int>(cfg_.model.num_layers);
  c10::NoGradGuard no_grad;
  math_.SetTraining(false);
  const std::vector<rp::model::LayerWeights> current = Layers(masters_);
  for (int64_t k = 0; k < cfg_.train.eval_microbatches; ++k) {
    eval_data_->FillEval(k, tokens_.data_ptr<int64_t>(), labels_.data_ptr<int64_t>(),
                         positions_.data_ptr<int64_t>());
    SetDocuments();
    at::Tensor x = math_.Embed(current[0], tokens_);
    for (int l = 1; l <= L; ++l) x = math_.Block(current[l], x, l);
    auto r = math_.HeadForwardBackward(current[L + 1], x, labels_, 1.0, /*backward=*/false);
    sums.loss += r.loss_sum;
    sums.targets += r.targets;
  }
  math_.SetTraining(true);
  if (sums.targets == 0)
    return rp::Status::InvalidArgument("data: the eval set has no target tokens");
  return sums;
}

rp::Status ReferenceTrainer::Run() {
  for (int64_t step = 0; step < cfg_.train.steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    const Sums train = ComputeStep(step);
    RP_ASSIGN_OR_RETURN(const rp::coord::OptimizerStepResult res, Update(step));
    RP_ASSIGN_OR_RETURN(const Sums eval, Evaluate(step));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rp::core::StepMetrics m;
    m.step = step + 1;
    m.loss = train.loss / static_cast<double>(train.targets);
    m.lr = rp::core::LearningRate(cfg_.optimizer, step, cfg_.train.steps);
    m.grad_norm = res.grad_norm;
    m.tokens = rp::core::Round(cfg_).calls * rp::core::Round(cfg_).microbatches *
               cfg_.train.microbatch_size * cfg_.data.seq_len;
    m.step_time_s = secs;
    if (eval.targets > 0) {
      m.eval_loss = eval.loss / static_cast<double>(eval.targets);
      m.eval_tokens = eval.targets;
    }
    if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm))
      return rp::Status::NonFinite("step " + std::to_string(step + 1) + ": the gradient norm is " +
                                   std::to_string(m.grad_norm) +
                                   " (not finite): training diverged");
    RP_RETURN_IF_ERROR(metrics_.Append(m));
    RP_LOG(INFO) << "step " << m.step << " loss " << m.loss << " grad_norm " << m.grad_norm
                 << (m.eval_loss >= 0 ? " eval_loss " + std::to_string(m.eval_loss)
                                      : std::string());
  }
  // The same exports as the coordinator's.
  return rp::core::ExportTrainedModel(
      cfg_, spec_, [&](int p) { return masters_[p].data_ptr<float>(); },
      [&](int f, float* out) {
        std::memcpy(out, frozen_[f].data_ptr<float>(), frozen_[f].numel() * sizeof(float));
      });
}

rp::Status Train(const std::string& job, const std::vector<std::string>& overrides) {
  RP_ASSIGN_OR_RETURN(std::unique_ptr<ReferenceTrainer> trainer,
                      ReferenceTrainer::Open(job, overrides));
  return trainer->Run();
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
