// SPDX-License-Identifier: Apache-2.0
// Hugging Face model directories: config.json + model.safetensors (or sharded
// model-0000x-of-0000y.safetensors with model.safetensors.index.json), in and out.
//
// Contract:
//  * The architecture in config.json is config/hf_config.h's (ApplyHfConfig, HfConfigJson).
//  * HfWeights::Open() opens the directory's safetensors file(s) through the validated reader
//    (io/safetensors.h); Load() converts one parameter (F32, BF16 or F16 on disk) to fp32 into
//    caller memory, e.g. the master arena, after checking its shape against the model spec. A
//    missing tensor is an error naming it (a tied LM head may be absent). A sparse block's
//    experts load from transformers 5's fused tensors (mlp.experts.gate_up_proj, down_proj) or
//    from one tensor per expert and projection (mlp.experts.<e>.gate_proj.weight, ...: the
//    layout of the published Qwen3-MoE checkpoints), whichever the directory has.
//  * ExportHf() writes a directory that transformers loads: config.json and tensors in
//    HfExport::dtype (rounded to nearest even from fp32) under the spec's (Hugging Face) names,
//    each file written atomically; config.json names that dtype and, from the base's config.json,
//    its bos/eos/pad token ids; the base's tokenizer files and generation_config.json are copied
//    (CopyBaseFiles); experts one tensor per expert
//    and projection, the layout every transformers version reads. Up to `shard_bytes` of tensors
//    (0: no limit) it is one model.safetensors; beyond, shards model-0000i-of-0000N.safetensors
//    (tensors in spec order, a tensor larger than the limit alone in its shard) and
//    model.safetensors.index.json, the layout save_pretrained uses. The other layout's files
//    left by an earlier export into the same directory are removed after the new one is written,
//    so a loader never sees both.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "io/safetensors.h"

namespace rp::core {

class HfWeights {
 public:
  static StatusOr<HfWeights> Open(const std::string& dir);
  Status Load(const ParamSpec& param, float* out) const;
  // The tensor is there with the parameter's shape (what Load checks, without reading it).
  Status Check(const ParamSpec& param) const;

 private:
  // Shape check and read of one named tensor.
  Status CheckTensor(const std::string& name, const std::vector<int64_t>& shape) const;
  Status LoadTensor(const std::string& name, const std::vector<int64_t>& shape, float* out) const;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;  // tensor name -> file
};

// The per-expert tensors a fused expert parameter (ModelSpec: roles experts.gate_up and
// experts.down) is stored as in a per-expert checkpoint, with their offsets in the parameter;
// empty for every other parameter.
struct ExpertPiece {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // elements
};
std::vector<ExpertPiece> ExpertPieces(const ParamSpec& param);

struct HfExport {
  uint64_t shard_bytes = 0;                   // 0: one file
  ExportDtype dtype = ExportDtype::kFloat32;  // resolved (never kAuto)
  std::string base_dir;                       // the base model's directory; "" = none
};

// `master(p)` returns parameter p's fp32 values (numel floats).
Status ExportHf(const std::string& dir, const ModelConfig& model, const ModelSpec& spec,
                const std::function<const float*(int)>& master, const HfExport& how = {});

// Copies into `dir` what of the base model's directory a loader needs besides weights and
// config.json: the tokenizer's files (tokenizer.json, tokenizer_config.json,
// special_tokens_map.json, tokenizer.model, vocab.json, merges.txt, added_tokens.json, chat
// template files) and, with `generation`, generation_config.json; each atomically, those it has.
Status CopyBaseFiles(const std::string& base_dir, const std::string& dir, bool generation);

}  // namespace rp::core
