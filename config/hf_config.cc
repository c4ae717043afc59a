// SPDX-License-Identifier: Apache-2.0
#include "config/hf_config.h"
#include "common/environment.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

namespace rp::core {

StatusOr<nlohmann::json> ReadJsonObject(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::InvalidArgument("model.path: cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return Status::InvalidArgument("model.path: " + path + " is not a JSON object");
  return j;
}

namespace {

// Typed reads of config.json values: a wrong JSON type or an out-of-range value is an error
// naming the file and the key, never an exception.
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& j, std::string where) : j_(j), where_(std::move(where)) {}

  bool Has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  Status Error(const std::string& key, const std::string& what) const {
    return Status::InvalidArgument(where_ + key + ": " + what);
  }
  // A positive integer; `*out` keeps its value when the key is absent and not required.
  Status PositiveInt(const char* key, int64_t* out, bool required) const {
    if (!Has(key)) return required ? Error(key, "is missing") : Status::Ok();
    const auto& v = j_[key];
    if (!v.is_number_integer() || v.get<int64_t>() <= 0)
      return Error(key, "must be a positive integer, got " + v.dump());
    *out = v.get<int64_t>();
    return Status::Ok();
  }
  // A number in (lo, hi]; `*out` keeps its value when absent.
  // A number of any value, for values whose range is the job key's (CheckModelValue).
  Status Number(const char* key, double* out) const {
    return Number(key, out, -std::numeric_limits<double>::max(),
                  std::numeric_limits<double>::max());
  }
  Status Number(const char* key, double* out, double lo, double hi) const {
    if (!Has(key)) return Status::Ok();
    const auto& v = j_[key];
    if (!v.is_number()) return Error(key, "must be a number, got " + v.dump());
    if (!std::isfinite(v.get<double>()) || v.get<double>() <= lo || v.get<double>() > hi)
      return Error(key, "must be in (" + Fmt(lo) + ", " + Fmt(hi) + "], got " + v.dump());
    *out = v.get<double>();
    return Status::Ok();
  }
  Status Bool(const char* key, bool* out) const {
    if (!Has(key)) return Status::Ok();
    if (!j_[key].is_boolean()) return Error(key, "must be true or false, got " + j_[key].dump());
    *out = j_[key].get<bool>();
    return Status::Ok();
  }
  Status String(const char* key, std::string* out) const {
    if (!Has(key)) return Status::Ok();
    if (!j_[key].is_string()) return Error(key, "must be a string, got " + j_[key].dump());
    *out = j_[key].get<std::string>();
    return Status::Ok();
  }

 private:
  static std::string Fmt(double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  }
  const nlohmann::json& j_;
  std::string where_;
};

// The RoPE of a config: `rope_scaling` (transformers 4's key, which transformers 5 still takes
// first) or `rope_parameters` (what transformers 5 writes), with the base inside it or at the top
// level, as transformers 5's standardization resolves them.
Status ReadRope(const nlohmann::json& j, const ConfigReader& top, const std::string& path,
                int64_t max_position, RopeConfig* rope) {
  *rope = RopeConfig{};
  RP_RETURN_IF_ERROR(top.Number("rope_theta", &rope->theta));
  const char* key = nullptr;
  for (const char* k : {"rope_scaling", "rope_parameters"}) {
    if (!j.contains(k) || j[k].is_null()) continue;
    if (!j[k].is_object()) return top.Error(k, "must be an object, got " + j[k].dump());
    if (!j[k].empty()) {
      key = k;
      break;
    }
  }
  if (key == nullptr) return Status::Ok();
  const nlohmann::json& r = j[key];
  const ConfigReader in(r, path + ": " + key + ".");
  std::string type = "default";
  RP_RETURN_IF_ERROR(in.String("type", &type));  // transformers 4's spelling
  RP_RETURN_IF_ERROR(in.String("rope_type", &type));
  for (auto it = r.begin(); it != r.end(); ++it)
    if (it.value().is_object())
      return in.Error(
          it.key(), "per-layer-type RoPE parameters are not supported (one RoPE for every layer)");
  RP_RETURN_IF_ERROR(in.Number("rope_theta", &rope->theta));
  double partial = 1.0;
  RP_RETURN_IF_ERROR(in.Number("partial_rotary_factor", &partial, 0.0, 1.0));
  if (partial != 1.0)
    return in.Error("partial_rotary_factor",
                    "rotating part of each head is not supported (only 1.0)");
  // transformers takes a top-level original_max_position_embeddings over the dictionary's.
  auto original = [&]() -> Status {
    rope->original_max_position = max_position;
    RP_RETURN_IF_ERROR(
        in.PositiveInt("original_max_position_embeddings", &rope->original_max_position, false));
    return top.PositiveInt("original_max_position_embeddings", &rope->original_max_position, false);
  };
  constexpr double kBig = 1e9;
  if (type == "default") {
    rope->type = RopeConfig::Type::kDefault;
  } else if (type == "linear") {
    rope->type = RopeConfig::Type::kLinear;
    if (!in.Has("factor")) return in.Error("factor", "is missing (rope_type \"linear\")");
    RP_RETURN_IF_ERROR(in.Number("factor", &rope->factor, 0.0, kBig));
  } else if (type == "llama3") {
    rope->type = RopeConfig::Type::kLlama3;
    for (const char* k : {"factor", "low_freq_factor", "high_freq_factor"})
      if (!in.Has(k)) return in.Error(k, "is missing (rope_type \"llama3\")");
    RP_RETURN_IF_ERROR(in.Number("factor", &rope->factor, 0.0, kBig));
    RP_RETURN_IF_ERROR(in.Number("low_freq_factor", &rope->low_freq_factor, 0.0, kBig));
    RP_RETURN_IF_ERROR(in.Number("high_freq_factor", &rope->high_freq_factor, 0.0, kBig));
    if (rope->high_freq_factor <= rope->low_freq_factor)
      return in.Error("high_freq_factor", "must be above low_freq_factor");
    RP_RETURN_IF_ERROR(original());
  } else if (type == "yarn") {
    rope->type = RopeConfig::Type::kYarn;
    RP_RETURN_IF_ERROR(original());
    rope->factor =
        static_cast<double>(max_position) / static_cast<double>(rope->original_max_position);
    RP_RETURN_IF_ERROR(in.Number("factor", &rope->factor, 0.0, kBig));
    // transformers: 0.1 * mscale * ln(factor) + 1 (1 at factor <= 1), the ratio of two such
    // terms when mscale and mscale_all_dim are both set and non-zero, unless stated outright.
    auto m = [&](double scale) {
      return rope->factor <= 1.0 ? 1.0 : 0.1 * scale * std::log(rope->factor) + 1.0;
    };
    double mscale = 0.0, mscale_all_dim = 0.0;
    RP_RETURN_IF_ERROR(in.Number("mscale", &mscale, -kBig, kBig));
    RP_RETURN_IF_ERROR(in.Number("mscale_all_dim", &mscale_all_dim, -kBig, kBig));
    rope->attention_factor =
        mscale != 0.0 && mscale_all_dim != 0.0 ? m(mscale) / m(mscale_all_dim) : m(1.0);
    RP_RETURN_IF_ERROR(in.Number("attention_factor", &rope->attention_factor, 0.0, kBig));
    // A zero beta means the default in transformers (`or 32`, `or 1`).
    double fast = 0.0, slow = 0.0;
    RP_RETURN_IF_ERROR(in.Number("beta_fast", &fast, -kBig, kBig));
    RP_RETURN_IF_ERROR(in.Number("beta_slow", &slow, -kBig, kBig));
    if (fast != 0.0) rope->beta_fast = fast;
    if (slow != 0.0) rope->beta_slow = slow;
    if (rope->beta_fast <= 0.0 || rope->beta_slow <= 0.0)
      return in.Error("beta_fast", "beta_fast and beta_slow must be positive");
    RP_RETURN_IF_ERROR(in.Bool("truncate", &rope->truncate));
  } else {
    return in.Error("rope_type",
                    "\"" + type + "\" is not supported (default, linear, llama3, yarn)");
  }
  return Status::Ok();
}

// Whether a Qwen2/Qwen3 config attends through a sliding window in any layer, as transformers
// decides it: use_sliding_window, then layer_types (or, without it, the layers from
// max_window_layers on).
StatusOr<bool> QwenUsesWindow(const nlohmann::json& j, const ConfigReader& top, int64_t layers) {
  // Both keys are checked whether or not a window is in use: a malformed value is a broken file.
  bool use = false, any_sliding = false;
  RP_RETURN_IF_ERROR(top.Bool("use_sliding_window", &use));
  if (top.Has("layer_types")) {
    if (!j["layer_types"].is_array()) return top.Error("layer_types", "must be a list");
    for (const auto& t : j["layer_types"]) {
      if (t == "sliding_attention") any_sliding = true;
      else if (t != "full_attention")
        return top.Error(
            "layer_types",
            "entry " + t.dump() + " is not supported (full_attention, sliding_attention)");
    }
  }
  int64_t full_layers = 28;  // transformers' default max_window_layers
  RP_RETURN_IF_ERROR(top.PositiveInt("max_window_layers", &full_layers, false));
  if (!use) return false;
  if (top.Has("layer_types")) return any_sliding;
  return layers > full_layers;
}

// Qwen3-MoE's experts, with Qwen3MoeConfig's defaults for absent keys. The number of experts is
// num_experts or num_local_experts (the name the config class maps it to).
Status ReadMoe(const nlohmann::json& j, const ConfigReader& top, int64_t layers, MoeConfig* moe) {
  *moe = MoeConfig{};
  moe->num_experts = 128;
  moe->experts_per_token = 8;
  moe->expert_intermediate_size = 768;
  RP_RETURN_IF_ERROR(top.PositiveInt("num_experts", &moe->num_experts, false));
  if (top.Has("num_local_experts")) {
    int64_t local = 0;
    RP_RETURN_IF_ERROR(top.PositiveInt("num_local_experts", &local, false));
    if (top.Has("num_experts") && local != moe->num_experts)
      return top.Error("num_local_experts",
                       "disagrees with num_experts (" + std::to_string(moe->num_experts) + ")");
    moe->num_experts = local;
  }
  RP_RETURN_IF_ERROR(top.PositiveInt("num_experts_per_tok", &moe->experts_per_token, false));
  if (moe->experts_per_token > moe->num_experts)
    return top.Error("num_experts_per_tok", std::to_string(moe->experts_per_token) +
                                                " is more than the " +
                                                std::to_string(moe->num_experts) + " experts");
  RP_RETURN_IF_ERROR(
      top.PositiveInt("moe_intermediate_size", &moe->expert_intermediate_size, false));
  RP_RETURN_IF_ERROR(top.Bool("norm_topk_prob", &moe->norm_topk_prob));
  RP_RETURN_IF_ERROR(top.PositiveInt("decoder_sparse_step", &moe->sparse_step, false));
  if (top.Has("mlp_only_layers")) {
    if (!j["mlp_only_layers"].is_array())
      return top.Error("mlp_only_layers", "must be a list of layer indices");
    for (const auto& v : j["mlp_only_layers"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= layers)
        return top.Error("mlp_only_layers", "entry " + v.dump() + " is not a layer index in [0, " +
                                                std::to_string(layers) + ")");
      moe->dense_layers.push_back(v.get<int64_t>());
    }
  }
  // The load-balancing loss is part of the training objective exactly when this is true
  // (transformers adds router_aux_loss_coef x it to the loss).
  bool router_loss = false;
  RP_RETURN_IF_ERROR(top.Bool("output_router_logits", &router_loss));
  double coef = 0.001;
  RP_RETURN_IF_ERROR(top.Number("router_aux_loss_coef", &coef, -1.0, 1e6));
  if (coef < 0.0) return top.Error("router_aux_loss_coef", "must not be negative");
  moe->aux_loss_weight = router_loss ? coef : 0.0;
  return Status::Ok();
}

}  // namespace

std::string HfBaseDtype(const std::string& dir) {
  auto j = ReadJsonObject((std::filesystem::path(dir) / "config.json").string());
  if (!j.ok()) return "";
  for (const char* key : {"dtype", "torch_dtype"})
    if (j->contains(key) && (*j)[key].is_string()) return (*j)[key].get<std::string>();
  return "";
}

Status ApplyHfConfig(const std::string& dir, ModelConfig* m) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  RP_ASSIGN_OR_RETURN(auto j, ReadJsonObject(path));
  const ConfigReader top(j, path + ": ");
  // Nothing of the job's [model] architecture survives: every value comes from this file or is
  // transformers' default for the model type.
  ModelConfig c;
  c.path = m->path;
  c.init_std = m->init_std;
  RP_RETURN_IF_ERROR(top.String("model_type", &c.model_type));
  const std::string& type = c.model_type;
  if (type != "llama" && type != "qwen2" && type != "qwen3" && type != "qwen3_moe" &&
      type != "mistral")
    return top.Error("model_type",
                     "\"" + type + "\" is not supported (llama, qwen2, qwen3, qwen3_moe, mistral)");
  const bool qwen3_family = type == "qwen3" || type == "qwen3_moe";
  if (top.Has("architectures")) {
    if (!j["architectures"].is_array()) return top.Error("architectures", "must be a list");
    for (const auto& a : j["architectures"]) {
      const std::string name = a.is_string() ? a.get<std::string>() : a.dump();
      if (!name.ends_with("ForCausalLM"))
        return top.Error("architectures",
                         "\"" + name + "\" is not a causal language model head (...ForCausalLM)");
    }
  }
  RP_RETURN_IF_ERROR(top.PositiveInt("vocab_size", &c.vocab_size, true));
  RP_RETURN_IF_ERROR(top.PositiveInt("hidden_size", &c.hidden_size, true));
  RP_RETURN_IF_ERROR(top.PositiveInt("intermediate_size", &c.intermediate_size, true));
  RP_RETURN_IF_ERROR(top.PositiveInt("num_hidden_layers", &c.num_layers, true));
  RP_RETURN_IF_ERROR(top.PositiveInt("num_attention_heads", &c.num_heads, true));
  c.num_kv_heads = c.num_heads;
  RP_RETURN_IF_ERROR(top.PositiveInt("num_key_value_heads", &c.num_kv_heads, false));
  // Qwen3's config class defaults head_dim to 128; the others (Qwen3-MoE too) derive it.
  c.head_dim = type == "qwen3" && !j.contains("head_dim") ? 128 : c.hidden_size / c.num_heads;
  RP_RETURN_IF_ERROR(top.PositiveInt("head_dim", &c.head_dim, false));
  // The same ranges as the job's [model] keys.
  const std::pair<const char*, int64_t*> sizes[] = {{"vocab_size", &c.vocab_size},
                                                    {"hidden_size", &c.hidden_size},
                                                    {"intermediate_size", &c.intermediate_size},
                                                    {"num_layers", &c.num_layers},
                                                    {"num_heads", &c.num_heads},
                                                    {"num_kv_heads", &c.num_kv_heads},
                                                    {"head_dim", &c.head_dim}};
  const char* const hf_names[] = {"vocab_size",        "hidden_size",         "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                  "head_dim"};
  for (size_t i = 0; i < std::size(sizes); ++i)
    RP_RETURN_IF_ERROR(CheckModelValue(sizes[i].first, static_cast<double>(*sizes[i].second),
                                       path + ": " + hf_names[i]));
  RP_RETURN_IF_ERROR(top.PositiveInt("max_position_embeddings", &c.max_position_embeddings, false));
  RP_RETURN_IF_ERROR(ReadRope(j, top, path, c.max_position_embeddings, &c.rope));
  RP_RETURN_IF_ERROR(
      CheckModelValue("rope_theta", c.rope.theta, path + ": RoPE base (rope_theta)"));
  double partial = 1.0;
  RP_RETURN_IF_ERROR(top.Number("partial_rotary_factor", &partial, 0.0, 1.0));
  if (partial != 1.0)
    return top.Error("partial_rotary_factor",
                     "rotating part of each head is not supported (only 1.0)");
  c.rms_norm_eps = 1e-6;
  RP_RETURN_IF_ERROR(top.Number("rms_norm_eps", &c.rms_norm_eps));
  RP_RETURN_IF_ERROR(CheckModelValue("rms_norm_eps", c.rms_norm_eps, path + ": rms_norm_eps"));
  c.tie_embeddings = false;
  RP_RETURN_IF_ERROR(top.Bool("tie_word_embeddings", &c.tie_embeddings));
  c.qk_norm = qwen3_family;
  if (type == "qwen3_moe") RP_RETURN_IF_ERROR(ReadMoe(j, top, c.num_layers, &c.moe));
  // Biases as each family's attention and MLP build them: Qwen2 always has q/k/v biases (and
  // none on o_proj); Llama and Qwen3 follow attention_bias (all four projections), Llama also
  // mlp_bias; Mistral has none. A key a family does not read changes nothing there.
  bool attention_bias = false, mlp_bias = false;
  RP_RETURN_IF_ERROR(top.Bool("attention_bias", &attention_bias));
  RP_RETURN_IF_ERROR(top.Bool("mlp_bias", &mlp_bias));
  c.qkv_bias = type == "qwen2" || ((type == "llama" || qwen3_family) && attention_bias);
  c.o_bias = (type == "llama" || qwen3_family) && attention_bias;
  c.mlp_bias = type == "llama" && mlp_bias;
  std::string act = "silu";
  RP_RETURN_IF_ERROR(top.String("hidden_act", &act));
  if (act != "silu")
    return top.Error("hidden_act", "\"" + act + "\" is not supported (silu: SwiGLU)");
  double dropout = 0.0;
  RP_RETURN_IF_ERROR(top.Number("attention_dropout", &dropout, -1.0, 1.0));
  if (dropout != 0.0)
    return top.Error("attention_dropout", "dropout on attention weights is not supported (only 0)");
  if (top.Has("quantization_config"))
    return top.Error("quantization_config", "quantized checkpoints are not supported");
  // Sliding windows: Mistral's applies to every layer (4096 when the key is absent, none when
  // null); Qwen2/Qwen3's only with use_sliding_window. Windows no shorter than the sequence are
  // plain causal attention, which CrossValidate checks against data.seq_len.
  c.sliding_window = 0;
  bool windowed = false;
  if (type == "mistral") {
    windowed = !j.contains("sliding_window") || !j["sliding_window"].is_null();
    if (!j.contains("sliding_window")) c.sliding_window = 4096;
  } else if (type == "qwen2" || qwen3_family) {
    RP_ASSIGN_OR_RETURN(windowed, QwenUsesWindow(j, top, c.num_layers));
    if (windowed) c.sliding_window = 4096;
  }
  // The value is checked wherever the family has the key, used only where a window applies.
  int64_t window = c.sliding_window;
  if (type != "llama") RP_RETURN_IF_ERROR(top.PositiveInt("sliding_window", &window, false));
  if (windowed) c.sliding_window = window;
  *m = c;
  return Status::Ok();
}

StatusOr<nlohmann::ordered_json> HfConfigJson(const ModelConfig& m) {
  const std::string& type = m.model_type;
  static const std::map<std::string, const char*> kArchitecture = {
      {"llama", "LlamaForCausalLM"},
      {"qwen2", "Qwen2ForCausalLM"},
      {"qwen3", "Qwen3ForCausalLM"},
      {"qwen3_moe", "Qwen3MoeForCausalLM"},
      {"mistral", "MistralForCausalLM"}};
  auto arch = kArchitecture.find(type);
  if (arch == kArchitecture.end())
    return Status::InvalidArgument("export: model_type \"" + type + "\" is unknown");
  // What each family can express (ApplyHfConfig's rules read backwards).
  const bool qwen3_family = type == "qwen3" || type == "qwen3_moe";
  const bool qk_norm_ok = m.qk_norm == qwen3_family;
  const bool bias_ok = type == "qwen2"     ? m.qkv_bias && !m.o_bias && !m.mlp_bias
                       : type == "mistral" ? !m.qkv_bias && !m.o_bias && !m.mlp_bias
                       : qwen3_family      ? m.qkv_bias == m.o_bias && !m.mlp_bias
                                           : m.qkv_bias == m.o_bias;
  if (!qk_norm_ok || !bias_ok)
    return Status::InvalidArgument(
        "export: the model's q/k norm and biases cannot be written as model_type \"" + type + "\"");
  if ((m.moe.num_experts > 0) != (type == "qwen3_moe"))
    return Status::InvalidArgument(
        "export: experts can be written as model_type \"qwen3_moe\" only, not \"" + type + "\"");
  nlohmann::ordered_json rope = {{"rope_type", RopeTypeName(m.rope.type)},
                                 {"rope_theta", m.rope.theta}};
  switch (m.rope.type) {
    case RopeConfig::Type::kDefault: break;
    case RopeConfig::Type::kLinear: rope["factor"] = m.rope.factor; break;
    case RopeConfig::Type::kLlama3:
      rope["factor"] = m.rope.factor;
      rope["low_freq_factor"] = m.rope.low_freq_factor;
      rope["high_freq_factor"] = m.rope.high_freq_factor;
      rope["original_max_position_embeddings"] = m.rope.original_max_position;
      break;
    case RopeConfig::Type::kYarn:
      rope["factor"] = m.rope.factor;
      rope["original_max_position_embeddings"] = m.rope.original_max_position;
      rope["attention_factor"] = m.rope.attention_factor;  // resolved: no mscale left to apply
      rope["beta_fast"] = m.rope.beta_fast;
      rope["beta_slow"] = m.rope.beta_slow;
      rope["truncate"] = m.rope.truncate;
      break;
  }
  nlohmann::ordered_json c = {{"architectures", {arch->second}},
                              {"model_type", type},
                              {"vocab_size", m.vocab_size},
                              {"hidden_size", m.hidden_size},
                              {"intermediate_size", m.intermediate_size},
                              {"num_hidden_layers", m.num_layers},
                              {"num_attention_heads", m.num_heads},
                              {"num_key_value_heads", m.num_kv_heads},
                              {"head_dim", m.head_dim},
                              {"hidden_act", "silu"},
                              {"rms_norm_eps", m.rms_norm_eps},
                              {"tie_word_embeddings", m.tie_embeddings},
                              {"max_position_embeddings", m.max_position_embeddings},
                              // Both spellings of the base: transformers 5 reads rope_parameters,
                              // older readers the top-level key.
                              {"rope_theta", m.rope.theta},
                              {"rope_parameters", rope},
                              {"attention_dropout", 0.0},
                              {"dtype", "float32"},
                              {"torch_dtype", "float32"}};
  if (type == "llama" || qwen3_family) c["attention_bias"] = m.qkv_bias;
  if (type == "qwen3_moe") {
    c["num_experts"] = m.moe.num_experts;
    c["num_experts_per_tok"] = m.moe.experts_per_token;
    c["moe_intermediate_size"] = m.moe.expert_intermediate_size;
    c["norm_topk_prob"] = m.moe.norm_topk_prob;
    c["decoder_sparse_step"] = m.moe.sparse_step;
    c["mlp_only_layers"] = m.moe.dense_layers;
    c["output_router_logits"] = m.moe.aux_loss_weight > 0.0;
    c["router_aux_loss_coef"] = m.moe.aux_loss_weight > 0.0 ? m.moe.aux_loss_weight : 0.001;
  }
  if (type == "llama") c["mlp_bias"] = m.mlp_bias;
  if (type == "mistral")
    c["sliding_window"] =
        m.sliding_window > 0 ? nlohmann::ordered_json(m.sliding_window) : nlohmann::ordered_json();
  if (type == "qwen2" || qwen3_family) {
    c["use_sliding_window"] = m.sliding_window > 0;
    c["sliding_window"] =
        m.sliding_window > 0 ? nlohmann::ordered_json(m.sliding_window) : nlohmann::ordered_json();
    c["max_window_layers"] = m.sliding_window > 0 ? 0 : m.num_layers;
  }
  return c;
}

std::string HubCacheDir() {
  auto env = [](const char* name) -> std::string { return EnvironmentValue(name).value_or(""); };
  if (!env("HF_HUB_CACHE").empty()) return env("HF_HUB_CACHE");
  if (!env("HF_HOME").empty()) return env("HF_HOME") + "/hub";
  if (!env("XDG_CACHE_HOME").empty()) return env("XDG_CACHE_HOME") + "/huggingface/hub";
  return env("HOME") + "/.cache/huggingface/hub";
}

namespace {
// "org/name" with huggingface_hub's characters (letters, digits, '-', '_', '.'), neither part
// starting with '.', or "" when `id` is not of that form.
bool IsModelId(const std::string& id) {
  const size_t slash = id.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == id.size() ||
      id.find('/', slash + 1) != std::string::npos)
    return false;
  if (id[0] == '.' || id[slash + 1] == '.') return false;
  for (char ch : id)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_' && ch != '.' &&
        ch != '/')
      return false;
  return true;
}
}  // namespace

StatusOr<std::string> ResolveModelPath(const std::string& path, const std::string& base_dir) {
  namespace fs = std::filesystem;
  if (path.empty()) return path;
  const fs::path local = fs::path(path).is_absolute() ? fs::path(path) : fs::path(base_dir) / path;
  std::error_code ec;
  const std::string at = path.substr(0, path.find('@'));
  const std::string revision =
      path.find('@') == std::string::npos ? "main" : path.substr(path.find('@') + 1);
  if (fs::is_directory(local, ec) || !IsModelId(at) || revision.empty() ||
      revision.find("..") != std::string::npos)
    return local.lexically_normal().string();
  const std::string cache = HubCacheDir();
  const std::string repo =
      cache + "/models--" + at.substr(0, at.find('/')) + "--" + at.substr(at.find('/') + 1);
  const std::string download =
      "`hf download " + at + (revision == "main" ? "" : " --revision " + revision) +
      "` (huggingface_hub; `huggingface-cli download` in versions before 0.34)";
  std::string commit = revision;
  if (std::ifstream ref(repo + "/refs/" + revision); ref) {
    std::getline(ref, commit);
    if (commit.empty())
      return Status::InvalidArgument("model.path: " + repo + "/refs/" + revision + " is empty");
  }
  const std::string snapshot = repo + "/snapshots/" + commit;
  if (!fs::is_regular_file(snapshot + "/config.json", ec))
    return Status::InvalidArgument(
        "model.path: \"" + path + "\" is not a directory (" + local.lexically_normal().string() +
        ") and not in the Hugging Face cache (" +
        (fs::is_directory(repo, ec) ? snapshot + "/config.json is missing"
                                    : repo + " does not exist") +
        "); nothing is downloaded here: fetch it with " + download +
        ", or set HF_HUB_CACHE / HF_HOME");
  return snapshot;
}

}  // namespace rp::core
