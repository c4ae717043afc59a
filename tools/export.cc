// SPDX-License-Identifier: Apache-2.0
// rp-export RUN_DIR [--step N] [--merged] [--out DIR] [--dtype float32|bfloat16|float16]
//
// Turns a training-state checkpoint of a run (RUN_DIR/<checkpoint.dir>/step-*.rpstate, the newest
// or the one after step N) into what the run itself exports after its last step: a full
// fine-tune's Hugging Face directory, or a LoRA run's PEFT adapter (--merged: the merged model
// as a Hugging Face directory instead), in checkpoint.export_dtype (or --dtype) with the base's
// tokenizer, generation config and special-token ids. It reads RUN_DIR/run-spec.json (the run as
// resolved, which rp-launch writes there) and the checkpoint with every check --resume makes
// (the state hash, sizes, checksums; whole files or the shards of any node count); the LoRA base
// of a merged model comes from model.path, rounded to the run's compute dtype as the run held it.
// Host memory: the run's two segments (the checkpoint is read whole). Nothing is overwritten:
// an existing output directory is refused. The default output is RUN_DIR/export-step-N.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/exit_codes.h"
#include "common/exit_status.h"
#include "common/logging.h"
#include "config/model_spec.h"
#include "optim/adamw.h"
#include "optim/optimizer_step.h"
#include "optim/training_state.h"
#include "io/hf_model.h"
#include "io/peft.h"
#include "planning/run_spec.h"
#include "shm/layout.h"

namespace {

namespace fs = std::filesystem;
using rp::Status;

struct ExportOptions {
  std::string run_dir, out, dtype;
  int64_t step = -1;
  bool merged = false;
};

Status Export(const ExportOptions& o) {
  const std::string spec_path = (fs::path(o.run_dir) / "run-spec.json").string();
  std::error_code ec;
  if (!fs::is_regular_file(spec_path, ec))
    return Status::InvalidArgument(
        spec_path +
        " does not exist: RUN_DIR is the job.output_dir of an rp-launch run, "
        "where the coordinator keeps the run as resolved");
  RP_ASSIGN_OR_RETURN(rp::core::RunSpec run, rp::core::ReadRunSpec(spec_path));
  rp::core::JobConfig cfg = run.job;
  // Read as one node reads any checkpoint (whole, or every node's shares) back, from the
  // directory given, wherever the run wrote it.
  cfg.nodes = rp::core::NodesConfig{};
  cfg.job.output_dir = o.run_dir;
  const rp::core::ModelSpec spec = rp::core::BuildModelSpec(cfg.model, cfg.lora);
  if (o.merged && !spec.lora.enabled())
    return Status::InvalidArgument("--merged: " + o.run_dir +
                                   " is a full fine-tune; its export is the whole model already");
  if (o.merged && cfg.model.path.empty())
    return Status::InvalidArgument(
        "--merged: the run's LoRA base was the seeded random init (no model.path), which "
        "rp-export does not rebuild; export the adapter, or use the run's own merged export");
  if (!o.dtype.empty()) {
    if (o.dtype == "float32") cfg.checkpoint.export_dtype = rp::core::ExportDtype::kFloat32;
    else if (o.dtype == "bfloat16") cfg.checkpoint.export_dtype = rp::core::ExportDtype::kBfloat16;
    else if (o.dtype == "float16") cfg.checkpoint.export_dtype = rp::core::ExportDtype::kFloat16;
    else
      return Status::InvalidArgument("--dtype: \"" + o.dtype +
                                     "\" is not float32, bfloat16 or float16");
  }
  RP_ASSIGN_OR_RETURN(const rp::shm::ArenaLayout layout,
                      rp::shm::ComputeLayout(cfg, run.execution, spec, run.plan));
  auto found = rp::coord::FindTrainingState(rp::coord::CheckpointDir(cfg), o.step);
  if (!found.ok())
    return Status::InvalidArgument(found.status().message());  // said to the user as it is
  const rp::coord::StateFile file = *found;
  const fs::path out =
      o.out.empty() ? fs::path(o.run_dir) / ("export-step-" + std::to_string(file.steps_done))
                    : fs::path(o.out);
  if (fs::exists(out, ec))
    return Status::InvalidArgument(
        out.string() + " exists; rp-export writes a new directory and overwrites nothing");
  // The segments as the run held them, filled from the checkpoint (pages only where it writes).
  std::unique_ptr<uint8_t[]> optim(new uint8_t[std::max<uint64_t>(layout.optim_total_bytes, 1)]);
  std::unique_ptr<uint8_t[]> state(new uint8_t[std::max<uint64_t>(layout.total_bytes, 1)]);
  RP_RETURN_IF_ERROR(rp::coord::ReadTrainingStateShares(
      file, cfg, spec, layout, rp::coord::TrainingStateHash(cfg, spec, layout), optim.get(),
      state.get()));
  // Parameter p's fp32 weights after steps_done updates, where the run keeps them
  // (coord::HostState::Weights, one node).
  const int64_t version = file.steps_done;
  auto master = [&](int p) -> const float* {
    if (layout.masters_in_state)
      return reinterpret_cast<const float*>(
          state.get() + layout.ComputeCopy(p, static_cast<int>(version % layout.compute_buffers)));
    return reinterpret_cast<const float*>(optim.get() + layout.master[p]);
  };
  std::optional<rp::core::HfWeights> base;
  if (o.merged) {
    RP_ASSIGN_OR_RETURN(auto opened, rp::core::HfWeights::Open(cfg.model.path));
    base.emplace(std::move(opened));
  }
  Status frozen_status = Status::Ok();
  auto frozen = [&](int f, float* values) {
    // As the run held it: loaded from model.path, rounded to the compute dtype.
    const auto& param = spec.frozen[f];
    if (Status s = base->Load(param, values); !s.ok()) {
      if (frozen_status.ok()) frozen_status = s;
      return;
    }
    const auto dtype = rp::coord::ComputeDtypeOf(cfg.train.dtype);
    std::vector<uint8_t> copy(static_cast<size_t>(param.numel) * 4);
    rp::coord::ToComputeCopy(values, copy.data(), param.numel, dtype);
    rp::coord::FromComputeCopy(copy.data(), values, param.numel, dtype);
  };
  // One export of ExportTrainedModel's: the adapter, or the (merged) Hugging Face model.
  cfg.job.output_dir = out.parent_path().string();
  cfg.checkpoint.export_hf = spec.lora.enabled() && !o.merged ? "" : out.filename().string();
  cfg.lora.export_dir = spec.lora.enabled() && !o.merged ? out.filename().string() : "";
  RP_RETURN_IF_ERROR(rp::core::ExportTrainedModel(cfg, spec, master, frozen));
  RP_RETURN_IF_ERROR(frozen_status);
  std::printf("rp-export: %s after step %lld -> %s\n",
              spec.lora.enabled() ? (o.merged ? "the merged model" : "the adapter") : "the model",
              static_cast<long long>(version), out.string().c_str());
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  ExportOptions o;
  CLI::App app{
      "RoundPipe export: a training checkpoint as a Hugging Face directory or a PEFT adapter"};
  app.add_option("run_dir", o.run_dir, "the run's output directory (job.output_dir)")->required();
  app.add_option("--step", o.step, "the checkpoint after this many steps (default: the newest)");
  app.add_flag("--merged", o.merged,
               "LoRA: the merged model (W + alpha/rank * B A) instead of the adapter");
  app.add_option("--out", o.out,
                 "output directory (default RUN_DIR/export-step-N); must not exist");
  app.add_option("--dtype", o.dtype,
                 "float32, bfloat16 or float16 (default: the run's checkpoint.export_dtype)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : rp::kExitBadConfig;
  }
  rp::InitLogging(argv[0], "export");
  Status s = Export(o);
  if (!s.ok()) {
    std::fprintf(stderr, "rp-export: %s\n", s.message().c_str());
    return rp::ExitCodeFor(s);
  }
  return 0;
}
