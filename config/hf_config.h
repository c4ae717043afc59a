// SPDX-License-Identifier: Apache-2.0
// A Hugging Face model directory's config.json, in and out: the architecture half of a
// checkpoint (its weights are io/hf_model.h's).
//
// Contract:
//  * ApplyHfConfig() reads <dir>/config.json and replaces every architecture value of `model`
//    with it (model_type "llama", "qwen2", "qwen3", "qwen3_moe" or "mistral"), from wherever
//    transformers 4.x and 5.x put a value (RoPE base at the top level or inside rope_parameters /
//    rope_scaling), and with transformers' per-family default where a key is absent. Every value
//    read is type- and range-checked (the ranges of the job's [model] keys). A key whose value
//    changes the math and that this runtime does not implement (another rope_type, a partial rotary
//    factor, attention dropout, another activation, a quantized checkpoint, per-layer RoPE) is
//    refused naming the file and the key; keys that do not change the math are ignored.
//    docs/model-config.md lists every key.
//  * HfConfigJson() is the config.json an export writes: it loads in transformers 5 as the same
//    model, with the RoPE base both in rope_parameters and at the top level for older readers.
//  * ReadJsonObject() reads a JSON object file (config.json, a shard index), errors naming it.
//  * ResolveModelPath() turns model.path into the directory to read: a directory (relative to
//    the job file's directory `base_dir`) when one exists there; else a Hugging Face model id
//    ("org/name", or "org/name@revision" with a branch, tag or commit) found in the local hub
//    cache as huggingface_hub lays it out (models--org--name/refs/<revision> names the commit,
//    snapshots/<commit>/ holds the files). The cache is $HF_HUB_CACHE, else $HF_HOME/hub, else
//    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub; nothing is downloaded. A
//    model in neither place is an error giving the download command.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "config/job_config.h"

namespace rp::core {

Status ApplyHfConfig(const std::string& dir, ModelConfig* model);
// The dtype <dir>/config.json names ("dtype", as transformers 5 writes it, else "torch_dtype");
// "" when it names none or cannot be read.
std::string HfBaseDtype(const std::string& dir);
StatusOr<nlohmann::ordered_json> HfConfigJson(const ModelConfig& model);
StatusOr<nlohmann::json> ReadJsonObject(const std::string& path);
StatusOr<std::string> ResolveModelPath(const std::string& path, const std::string& base_dir);
// The hub cache ResolveModelPath() searches, from the environment.
std::string HubCacheDir();

}  // namespace rp::core
