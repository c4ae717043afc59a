// SPDX-License-Identifier: Apache-2.0
// PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors), in and out.
//
// Contract:
//  * Tensor names are PEFT's as save_pretrained writes them for a causal LM:
//    "base_model.model." + the spec's name, e.g.
//    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (no adapter name).
//    Expert adapters (lora.target_parameters) carry PEFT's nested wrapper names, e.g.
//    ...layers.0.mlp.experts.base_layer.lora_A.weight for gate_up_proj when both expert tensors
//    are targeted (core::ModelSpec).
//  * PeftAdapter::Open() checks adapter_config.json against the job (peft_type LORA, r,
//    lora_alpha, the sets of target_modules and target_parameters; DoRA, rsLoRA, biases,
//    fan_in_fan_out and per-layer patterns are refused because this runtime does not compute them)
//    and that the safetensors file holds exactly the spec's adapter tensors with their shapes;
//    every error names the directory or file and the problem. lora_dropout may differ (it only
//    affects training; the job's value is used).
//  * ExportPeft() writes both files (each atomically); the tensors are fp32.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "io/safetensors.h"

namespace rp::core {

std::string PeftTensorName(const std::string& spec_name);

class PeftAdapter {
 public:
  static StatusOr<PeftAdapter> Open(const std::string& dir, const ModelSpec& spec);
  // Parameter `p` of the spec (an adapter matrix) as fp32 into `out`.
  Status Load(const ParamSpec& p, float* out) const;

 private:
  std::unique_ptr<SafetensorsFile> file_;
};

// `master(p)` returns trainable parameter p's fp32 values. `base_model` goes into
// base_model_name_or_path (the job's model.path, or "" for a random base).
Status ExportPeft(const std::string& dir, const ModelSpec& spec, const std::string& base_model,
                  const std::function<const float*(int)>& master);

// Every weight file the run will read at its start is there, a regular file, holding each
// tensor it needs with its shape: model.path's checkpoint (the LoRA base, or the masters of a
// fresh full fine-tune) and lora.init_from's adapter. Reads headers only; what rp-launch checks
// before it starts anything (a bad path is a bad job, exit 2).
Status CheckInitialWeights(const JobConfig& cfg, const ModelSpec& spec, bool resume);

// Writes what a finished run leaves behind. Full fine-tune: checkpoint.export_hf (if set) from
// the masters, in checkpoint.export_dtype with the base's tokenizer, generation config and
// special-token ids (ExportHf). LoRA: lora.export (if set) in PEFT's layout (fp32) with the
// base's tokenizer files, and checkpoint.export_hf (if set) as the merged model
// W + alpha/rank * B A (summed in fp32 from the base as the run computed with it, then rounded to
// checkpoint.export_dtype).
// `master(p)` is trainable parameter p; `frozen(f, out)` writes frozen parameter f as fp32.
Status ExportTrainedModel(const JobConfig& cfg, const ModelSpec& spec,
                          const std::function<const float*(int)>& master,
                          const std::function<void(int, float*)>& frozen);

}  // namespace rp::core
