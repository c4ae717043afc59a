// SPDX-License-Identifier: Apache-2.0
#include "io/peft.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "io/hf_model.h"
#include "io/run_output.h"

namespace rp::core {
namespace {
namespace fs = std::filesystem;

constexpr char kConfigFile[] = "adapter_config.json";
constexpr char kWeightsFile[] = "adapter_model.safetensors";

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Checks adapter_config.json against the job's [lora] section.
Status CheckConfig(const std::string& path, const LoraConfig& lora) {
  std::ifstream in(path);
  if (!in)
    return Status::InvalidArgument(
        path + ": cannot read (lora.init_from needs PEFT's adapter_config.json)");
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(path + ": not valid JSON: " + e.what());
  }
  if (!c.is_object()) return Status::InvalidArgument(path + ": expected a JSON object");
  auto fail = [&](const std::string& key, const std::string& why) {
    return Status::InvalidArgument(path + ": \"" + key + "\" " + why);
  };
  if (!c.contains("peft_type") || !c["peft_type"].is_string() ||
      c["peft_type"].get<std::string>() != "LORA")
    return fail("peft_type", "must be \"LORA\", got " +
                                 (c.contains("peft_type") ? c["peft_type"].dump() : "nothing"));
  if (!c.contains("r") || !c["r"].is_number_integer() || c["r"].get<int64_t>() != lora.rank)
    return fail("r", (c.contains("r") ? "is " + c["r"].dump() : "is missing") + "; lora.rank is " +
                         std::to_string(lora.rank));
  if (!c.contains("lora_alpha") || !c["lora_alpha"].is_number() ||
      c["lora_alpha"].get<double>() != lora.alpha) {
    std::ostringstream m;
    m << (c.contains("lora_alpha") ? "is " + c["lora_alpha"].dump() : "is missing")
      << "; lora.alpha is " << lora.alpha;
    return fail("lora_alpha", m.str());
  }
  if (!c.contains("target_modules") || !c["target_modules"].is_array())
    return fail("target_modules",
                "must be a list of module names (a regular expression is not supported)");
  std::set<std::string> theirs, ours(lora.target_modules.begin(), lora.target_modules.end());
  for (const auto& t : c["target_modules"]) {
    if (!t.is_string()) return fail("target_modules", "holds a non-string " + t.dump());
    theirs.insert(t.get<std::string>());
  }
  auto joined = [](const std::set<std::string>& names) {
    std::string j;
    for (const auto& t : names) j += (j.empty() ? "" : ", ") + t;
    return j;
  };
  if (theirs != ours)
    return fail("target_modules",
                "is [" + joined(theirs) + "]; lora.target_modules is [" + joined(ours) + "]");
  // Absent or null means none, as in PEFT; names compare as the tensors they name (PEFT matches a
  // suffix after a dot).
  std::set<std::string> their_params, our_params;
  for (const auto& t : lora.target_parameters) our_params.insert(CanonicalLoraParameter(t));
  if (c.contains("target_parameters") && !c["target_parameters"].is_null()) {
    if (!c["target_parameters"].is_array())
      return fail("target_parameters", "must be a list of parameter names");
    for (const auto& t : c["target_parameters"]) {
      if (!t.is_string()) return fail("target_parameters", "holds a non-string " + t.dump());
      const std::string tensor = CanonicalLoraParameter(t.get<std::string>());
      their_params.insert(tensor.empty() ? t.get<std::string>() : tensor);
    }
    // Before peft 0.19 a [experts, out, in] tensor's adapter had in and out swapped (A [r x E,
    // out], B [in, r x E]): the same shapes for a square expert matrix, another function.
    if (!their_params.empty() && c.contains("peft_version") && c["peft_version"].is_string()) {
      const std::string v = c["peft_version"].get<std::string>();
      int major = 0, minor = 0;
      if (std::sscanf(v.c_str(), "%d.%d", &major, &minor) == 2 && (major == 0 && minor < 19))
        return fail(
            "peft_version",
            "is " + v +
                "; adapters on expert tensors (target_parameters) are read in the "
                "layout of peft 0.19 and later, which swapped in and out of [experts, out, in] "
                "tensors");
    }
  }
  if (their_params != our_params)
    return fail("target_parameters", "is [" + joined(their_params) +
                                         "]; lora.target_parameters is [" + joined(our_params) +
                                         "]");
  // Variants that change the math: refused by name rather than silently computed as plain LoRA.
  for (const char* key : {"use_dora", "use_rslora", "fan_in_fan_out", "lora_bias", "use_qalora"})
    if (c.contains(key) && c[key].is_boolean() && c[key].get<bool>())
      return fail(key, "is true; this runtime computes plain LoRA only");
  if (c.contains("bias") && c["bias"].is_string() && c["bias"].get<std::string>() != "none")
    return fail("bias", "is " + c["bias"].dump() + "; only \"none\" is supported");
  for (const char* key : {"layers_to_transform", "modules_to_save", "layer_replication",
                          "exclude_modules", "trainable_token_indices", "alora_invocation_tokens"})
    if (c.contains(key) && !c[key].is_null() && !(c[key].is_array() && c[key].empty()))
      return fail(key, "is set; this runtime adapts every layer and saves no extra modules");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (c.contains(key) && c[key].is_object() && !c[key].empty())
      return fail(key, "is set; per-module ranks or alphas are not supported");
  return Status::Ok();
}

// The tensors by their full names, in the order transformers registers them.
std::vector<std::string> ExportedTargetParameters(const LoraConfig& l) {
  std::vector<std::string> out;
  for (const auto& full : LoraTargetableParameters())
    for (const auto& t : l.target_parameters)
      if (CanonicalLoraParameter(t) == full) {
        out.push_back(full);
        break;
      }
  return out;
}
}  // namespace

std::string PeftTensorName(const std::string& spec_name) { return "base_model.model." + spec_name; }

StatusOr<PeftAdapter> PeftAdapter::Open(const std::string& dir, const ModelSpec& spec) {
  RP_RETURN_IF_ERROR(CheckConfig((fs::path(dir) / kConfigFile).string(), spec.lora));
  const std::string path = (fs::path(dir) / kWeightsFile).string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    return Status::InvalidArgument(path + ": no such file (a PEFT adapter directory holds " +
                                   std::string(kWeightsFile) + ")");
  RP_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
  PeftAdapter a;
  a.file_ = std::make_unique<SafetensorsFile>(std::move(f));
  std::set<std::string> expected;
  for (const auto& p : spec.params) {
    const std::string name = PeftTensorName(p.name);
    expected.insert(name);
    const SafetensorInfo* t = a.file_->Find(name);
    if (!t) return Status::InvalidArgument(path + ": no tensor \"" + name + "\"");
    if (t->shape != p.shape)
      return Status::InvalidArgument(path + ": tensor \"" + name + "\" has shape " +
                                     ShapeText(t->shape) + ", this job's adapter needs " +
                                     ShapeText(p.shape));
  }
  for (const auto& t : a.file_->tensors())
    if (!expected.count(t.name))
      return Status::InvalidArgument(
          path + ": tensor \"" + t.name +
          "\" is not an adapter of this model, target_modules and target_parameters");
  return a;
}

Status PeftAdapter::Load(const ParamSpec& p, float* out) const {
  const SafetensorInfo* t = file_->Find(PeftTensorName(p.name));
  if (!t)
    return Status::InvalidArgument(file_->path() + ": no tensor \"" + PeftTensorName(p.name) +
                                   "\"");
  return file_->ReadAsFloat(*t, out);
}

Status ExportPeft(const std::string& dir, const ModelSpec& spec, const std::string& base_model,
                  const std::function<const float*(int)>& master) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError("adapter export directory " + dir + ": " + ec.message());
  std::vector<SafetensorToWrite> tensors;
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const auto& ps = spec.params[p];
    tensors.push_back({PeftTensorName(ps.name), "F32", ps.shape, master(static_cast<int>(p)),
                       static_cast<uint64_t>(ps.numel) * 4});
  }
  RP_RETURN_IF_ERROR(
      WriteSafetensors((fs::path(dir) / kWeightsFile).string(), tensors, {{"format", "pt"}}));
  const LoraConfig& l = spec.lora;
  nlohmann::ordered_json c = {{"peft_type", "LORA"},
                              {"task_type", "CAUSAL_LM"},
                              {"base_model_name_or_path", base_model},
                              {"r", l.rank},
                              {"lora_alpha", l.alpha},
                              {"lora_dropout", l.dropout},
                              {"target_modules", l.target_modules},
                              {"target_parameters", ExportedTargetParameters(l)},
                              {"bias", "none"},
                              {"fan_in_fan_out", false},
                              {"inference_mode", true},
                              {"init_lora_weights", true},
                              {"use_rslora", false},
                              {"use_dora", false},
                              {"modules_to_save", nullptr},
                              {"layers_to_transform", nullptr},
                              {"rank_pattern", nlohmann::ordered_json::object()},
                              {"alpha_pattern", nlohmann::ordered_json::object()}};
  return WriteFileAtomically((fs::path(dir) / kConfigFile).string(), c.dump(2) + "\n");
}

Status ExportTrainedModel(const JobConfig& cfg, const ModelSpec& spec,
                          const std::function<const float*(int)>& master,
                          const std::function<void(int, float*)>& frozen) {
  const HfExport how{static_cast<uint64_t>(cfg.checkpoint.export_shard_mb) << 20,
                     cfg.checkpoint.export_dtype, cfg.model.path};
  const std::string hf_dir =
      cfg.checkpoint.export_hf.empty()
          ? ""
          : (fs::path(cfg.job.output_dir) / cfg.checkpoint.export_hf).string();
  if (!spec.lora.enabled()) {
    if (hf_dir.empty()) return Status::Ok();
    return ExportHf(hf_dir, cfg.model, spec, master, how);
  }
  if (!cfg.lora.export_dir.empty()) {
    const std::string adapter_dir = (fs::path(cfg.job.output_dir) / cfg.lora.export_dir).string();
    RP_RETURN_IF_ERROR(ExportPeft(adapter_dir, spec, cfg.model.path, master));
    // As trainers save an adapter: with the base's tokenizer, so the directory is all a user loads.
    if (!cfg.model.path.empty())
      RP_RETURN_IF_ERROR(CopyBaseFiles(cfg.model.path, adapter_dir, /*generation=*/false));
  }
  if (hf_dir.empty()) return Status::Ok();
  // The full model's spec lists the base weights in the order and under the names of `frozen`.
  const ModelSpec full = BuildModelSpec(spec.config);
  if (full.params.size() != spec.frozen.size())
    return Status::Internal("merged export: the base has " + std::to_string(spec.frozen.size()) +
                            " tensors, the full model " + std::to_string(full.params.size()));
  std::vector<std::vector<float>> merged(spec.frozen.size());
  for (size_t f = 0; f < spec.frozen.size(); ++f) {
    merged[f].resize(static_cast<size_t>(spec.frozen[f].numel));
    frozen(static_cast<int>(f), merged[f].data());
  }
  // W += scale * B A, per adapted projection (A: [r, in], B: [out, r]); per expert e of an expert
  // adapter, W_e += scale * B_e A_e with A_e, B_e cut as core::ParamSpec::experts says.
  const float scale = static_cast<float>(spec.lora.scale());
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const auto& a = spec.params[p];  // a lora_A, directly followed by its lora_B (core::ModelSpec)
    if (a.adapts < 0) continue;
    if (p + 1 >= spec.params.size() || spec.params[p + 1].adapts != a.adapts)
      return Status::Internal("merged export: " + a.name + " is not followed by its lora_B");
    const float* A = master(static_cast<int>(p));
    const float* B = master(static_cast<int>(p + 1));
    const int64_t experts = std::max<int64_t>(a.experts, 1);
    const int64_t r = a.shape[0] / experts, in = a.shape[1], out = spec.params[p + 1].shape[0];
    const int64_t b_cols = r * experts;
    for (int64_t e = 0; e < experts; ++e) {
      float* W = merged[static_cast<size_t>(a.adapts)].data() + e * out * in;
      for (int64_t i = 0; i < out; ++i)
        for (int64_t k = 0; k < r; ++k) {
          const float b = scale * B[i * b_cols + (a.experts > 0 ? k * experts + e : k)];
          const float* arow = A + (e * r + k) * in;
          float* wrow = W + i * in;
          for (int64_t j = 0; j < in; ++j) wrow[j] += b * arow[j];
        }
    }
    ++p;  // its lora_B
  }
  return ExportHf(
      hf_dir, cfg.model, full, [&](int f) -> const float* { return merged[f].data(); }, how);
}

Status CheckInitialWeights(const JobConfig& cfg, const ModelSpec& spec, bool resume) {
  // On resume the trainable parameters come from the checkpoint; LoRA's frozen base never does.
  const bool masters_from_model = !resume && !spec.lora.enabled();
  if (!cfg.model.path.empty() && (!spec.frozen.empty() || masters_from_model)) {
    RP_ASSIGN_OR_RETURN(auto hf, HfWeights::Open(cfg.model.path));
    for (const auto& p : spec.frozen) RP_RETURN_IF_ERROR(hf.Check(p));
    if (masters_from_model)
      for (const auto& p : spec.params) RP_RETURN_IF_ERROR(hf.Check(p));
  }
  if (!resume && spec.lora.enabled() && !cfg.lora.init_from.empty())
    RP_RETURN_IF_ERROR(PeftAdapter::Open(cfg.lora.init_from, spec).status());
  return Status::Ok();
}

}  // namespace rp::core
