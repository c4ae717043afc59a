// SPDX-License-Identifier: Apache-2.0
#include "config/job_config.h"
#include "common/environment.h"

#include "config/cross_checks.h"
#include "config/execution_plan.h"
#include "config/mode_key_access.h"
#include "config/hf_config.h"
#include "common/closest_match.h"

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <regex>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>

namespace rp::core {
namespace {

namespace fs = std::filesystem;

using Setter = std::function<Status(const toml::node&, JobConfig&, const std::string& name)>;
// Puts the key's value in `config` into its section's table, as a job file would spell it.
using Getter = std::function<void(JobConfig& config, toml::table& section, const std::string& key)>;

struct KeySpec {
  KeyDoc doc;
  Setter set;
  Getter get;
};

// The [model] keys that only a mixture-of-experts model uses (num_experts itself decides whether
// it is one).
bool ExpertSettingKey(const std::string& key) {
  return key == "experts_per_token" || key == "expert_intermediate_size" ||
         key == "norm_topk_prob" || key == "sparse_step" || key == "router_aux_loss_coef";
}

std::string TypeOf(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::array: return "array";
    case toml::node_type::table: return "table";
    default: return "date/time";
  }
}

Status WrongType(const std::string& name, const char* want, const toml::node& n) {
  // The value as given, so that a long file's mistake can be found.
  std::ostringstream given;
  n.visit([&given](const auto& v) {
    if constexpr (toml::is_value<decltype(v)>) given << " " << v;
  });
  std::string text = given.str();
  if (text.size() > 64) text = text.substr(0, 60) + " ...";
  return Status::InvalidArgument(name + ": expected " + want + ", got " + TypeOf(n) + text);
}

template <typename Field>
KeySpec Int(std::string section, std::string key, Field field, int64_t def, int64_t lo, int64_t hi,
            std::string meaning) {
  KeySpec s;
  std::string range =
      "range [" + std::to_string(lo) + ", " +
      (hi == std::numeric_limits<int64_t>::max() ? std::string("inf") : std::to_string(hi)) + "]";
  s.doc = {section, key, "int", std::to_string(def), meaning + " (" + range + ")"};
  s.set = [field, lo, hi](const toml::node& n, JobConfig& c, const std::string& name) -> Status {
    auto v = n.value_exact<int64_t>();
    if (!v) return WrongType(name, "an integer", n);
    if (*v < lo || *v > hi)
      return Status::InvalidArgument(name + ": must be in [" + std::to_string(lo) + ", " +
                                     std::to_string(hi) + "], got " + std::to_string(*v));
    field(c) = *v;
    return Status::Ok();
  };
  s.get = [field](JobConfig& c, toml::table& t, const std::string& k) {
    t.insert_or_assign(k, field(c));
  };
  return s;
}

template <typename Field>
KeySpec Float(std::string section, std::string key, Field field, double def, double lo, double hi,
              std::string meaning) {
  KeySpec s;
  std::ostringstream d;
  d << def;
  s.doc = {section, key, "float", d.str(), meaning};
  s.set = [field, lo, hi](const toml::node& n, JobConfig& c, const std::string& name) -> Status {
    std::optional<double> v;
    if (auto f = n.value_exact<double>()) v = *f;
    else if (auto i = n.value_exact<int64_t>()) v = static_cast<double>(*i);
    if (!v) return WrongType(name, "a number", n);
    if (!(*v >= lo && *v <= hi)) {
      std::ostringstream m;
      m << name << ": must be in [" << lo << ", " << hi << "], got " << *v;
      return Status::InvalidArgument(m.str());
    }
    field(c) = *v;
    return Status::Ok();
  };
  s.get = [field](JobConfig& c, toml::table& t, const std::string& k) {
    t.insert_or_assign(k, static_cast<double>(field(c)));
  };
  return s;
}

template <typename Field>
KeySpec Bool(std::string section, std::string key, Field field, bool def, std::string meaning) {
  KeySpec s;
  s.doc = {section, key, "bool", def ? "true" : "false", meaning};
  s.set = [field](const toml::node& n, JobConfig& c, const std::string& name) -> Status {
    auto v = n.value_exact<bool>();
    if (!v) return WrongType(name, "true or false", n);
    field(c) = *v;
    return Status::Ok();
  };
  s.get = [field](JobConfig& c, toml::table& t, const std::string& k) {
    t.insert_or_assign(k, field(c));
  };
  return s;
}

template <typename Field>
KeySpec Str(std::string section, std::string key, Field field, std::string def,
            std::string meaning) {
  KeySpec s;
  s.doc = {section, key, "string", "\"" + def + "\"", meaning};
  s.set = [field](const toml::node& n, JobConfig& c, const std::string& name) -> Status {
    auto v = n.value_exact<std::string>();
    if (!v) return WrongType(name, "a string", n);
    field(c) = *v;
    return Status::Ok();
  };
  s.get = [field](JobConfig& c, toml::table& t, const std::string& k) {
    t.insert_or_assign(k, field(c));
  };
  return s;
}

// Each mode's spellings in job files, the one place they appear.
template <typename E>
using EnumNames = std::vector<std::pair<E, const char*>>;
const EnumNames<DeviceKind> kDeviceNames = {
    {DeviceKind::kAuto, "auto"}, {DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"}};
const EnumNames<DataFormat> kFormatNames = {{DataFormat::kBytes, "bytes"},
                                            {DataFormat::kTokens, "tokens"},
                                            {DataFormat::kJsonl, "jsonl"},
                                            {DataFormat::kRandom, "random"}};
const EnumNames<DataPacking> kPackingNames = {{DataPacking::kAuto, "auto"},
                                              {DataPacking::kStream, "stream"},
                                              {DataPacking::kDocuments, "documents"},
                                              {DataPacking::kPad, "pad"}};
const EnumNames<LongRecords> kLongRecordNames = {{LongRecords::kSplit, "split"},
                                                 {LongRecords::kTruncate, "truncate"},
                                                 {LongRecords::kDrop, "drop"}};
const EnumNames<TrainDtype> kDtypeNames = {{TrainDtype::kFp32, "fp32"},
                                           {TrainDtype::kBf16, "bf16"},
                                           {TrainDtype::kFp16, "fp16"},
                                           {TrainDtype::kFp8, "fp8"}};
const EnumNames<OptimizerName> kOptimizerNames = {{OptimizerName::kAdamW, "adamw"},
                                                  {OptimizerName::kSgd, "sgd"}};
const EnumNames<LrSchedule> kLrScheduleNames = {{LrSchedule::kCosine, "cosine"},
                                                {LrSchedule::kLinear, "linear"},
                                                {LrSchedule::kConstant, "constant"}};
const EnumNames<ExportDtype> kExportDtypeNames = {{ExportDtype::kAuto, "auto"},
                                                  {ExportDtype::kFloat32, "float32"},
                                                  {ExportDtype::kBfloat16, "bfloat16"},
                                                  {ExportDtype::kFloat16, "float16"}};
const EnumNames<OptimizerMode> kModeNames = {{OptimizerMode::kExact, "exact"},
                                             {OptimizerMode::kStale1, "stale1"}};
const EnumNames<OptimizerState> kStateNames = {{OptimizerState::kReplicated, "replicated"},
                                               {OptimizerState::kSharded, "sharded"}};
const EnumNames<GradientsWait> kGradientsWaitNames = {{GradientsWait::kHost, "host"},
                                                      {GradientsWait::kWorkers, "workers"}};
const EnumNames<Activations> kActivationNames = {{Activations::kHost, "host"},
                                                 {Activations::kWorker, "worker"},
                                                 {Activations::kCudaIpc, "cuda_ipc"}};
const EnumNames<WeightsSource> kWeightsNames = {{WeightsSource::kAuto, "auto"},
                                                {WeightsSource::kComputeCopy, "compute_copy"}};
const EnumNames<EmbeddingLookup> kLookupNames = {{EmbeddingLookup::kAuto, "auto"},
                                                 {EmbeddingLookup::kCopy, "copy"}};
const EnumNames<Partition> kPartitionNames = {{Partition::kEqual, "equal"},
                                              {Partition::kAuto, "auto"}};
const EnumNames<Tristate> kTristateNames = {
    {Tristate::kAuto, "auto"}, {Tristate::kAlways, "always"}, {Tristate::kNever, "never"}};

template <typename E>
const char* NameIn(const EnumNames<E>& names, E v) {
  for (const auto& [e, n] : names)
    if (e == v) return n;
  return "?";
}

template <typename E>
std::string ListOf(const EnumNames<E>& names) {
  std::string list;
  for (const auto& [e, n] : names) {
    if (!list.empty()) list += " | ";
    list += '"';
    list += n;
    list += '"';
  }
  return list;
}

template <typename E>
StatusOr<E> ParseEnum(const EnumNames<E>& names, const std::string& text, const std::string& name) {
  for (const auto& [e, n] : names)
    if (text == n) return e;
  std::vector<std::string> spelled;
  for (const auto& [e, n] : names) spelled.push_back(n);
  // Other tools' spellings of the same modes, then the closest name.
  static const std::vector<std::pair<std::string, std::string>> kOtherSpellings = {
      {"gpu", "cuda"},          {"bfloat16", "bf16"},
      {"float16", "fp16"},      {"half", "fp16"},
      {"float32", "fp32"},      {"float", "fp32"},
      {"adamw_torch", "adamw"}, {"cosine_with_min_lr", "cosine"},
      {"bf16", "bfloat16"},     {"fp16", "float16"},
      {"fp32", "float32"}};
  std::string close;
  for (const auto& [other, ours] : kOtherSpellings)
    if (text == other && std::find(spelled.begin(), spelled.end(), ours) != spelled.end())
      close = ours;
  if (close.empty()) close = ClosestMatch(text, spelled);
  return Status::InvalidArgument(name + ": must be one of " + ListOf(names) + ", got \"" + text +
                                 "\"" + (close.empty() ? "" : "; did you mean \"" + close + "\"?"));
}

template <typename Field, typename E>
KeySpec Enum(std::string section, std::string key, Field field, E def, const EnumNames<E>& names,
             std::string meaning) {
  KeySpec s;
  std::string quoted(1, '"');  // (built up: GCC 12 warns falsely on "\"" + std::string)
  quoted += NameIn(names, def);
  quoted += '"';
  s.doc = {section, key, "enum", quoted, meaning + " (" + ListOf(names) + ")"};
  s.set = [field, &names](const toml::node& n, JobConfig& c, const std::string& name) -> Status {
    auto v = n.value_exact<std::string>();
    if (!v) return WrongType(name, "a string", n);
    RP_ASSIGN_OR_RETURN(E e, ParseEnum(names, *v, name));
    field(c) = e;
    return Status::Ok();
  };
  s.get = [field, &names](JobConfig& c, toml::table& t, const std::string& k) {
    t.insert_or_assign(k, std::string(NameIn(names, field(c))));
  };
  return s;
}

template <typename Field>
KeySpec IntArray(std::string section, std::string key, Field field, std::string meaning) {
  KeySpec s;
  s.doc = {section, key, "int array", "[]", meaning};
  s.set = [field](const toml::node& n, JobConfig& c, const std::string& name) -> Status {
    const toml::array* arr = n.as_array();
    if (!arr) return WrongType(name, "an array of integers", n);
    std::vector<int64_t> out;
    for (size_t i = 0; i < arr->size(); ++i) {
      auto v = (*arr)[i].value_exact<int64_t>();
      if (!v) return WrongType(name + "[" + std::to_string(i) + "]", "an integer", (*arr)[i]);
      out.push_back(*v);
    }
    field(c) = out;
    return Status::Ok();
  };
  s.get = [field](JobConfig& c, toml::table& t, const std::string& k) {
    toml::array a;
    for (const auto& v : field(c)) a.push_back(v);
    t.insert_or_assign(k, std::move(a));
  };
  return s;
}

template <typename Field>
KeySpec StrArray(std::string section, std::string key, Field field, std::string def,
                 std::string meaning) {
  KeySpec s;
  s.doc = {section, key, "string array", def, meaning};
  s.set = [field](const toml::node& n, JobConfig& c, const std::string& name) -> Status {
    const toml::array* arr = n.as_array();
    if (!arr) return WrongType(name, "an array of strings", n);
    std::vector<std::string> out;
    for (size_t i = 0; i < arr->size(); ++i) {
      auto v = (*arr)[i].value_exact<std::string>();
      if (!v) return WrongType(name + "[" + std::to_string(i) + "]", "a string", (*arr)[i]);
      out.push_back(*v);
    }
    field(c) = out;
    return Status::Ok();
  };
  s.get = [field](JobConfig& c, toml::table& t, const std::string& k) {
    toml::array a;
    for (const auto& v : field(c)) a.push_back(v);
    t.insert_or_assign(k, std::move(a));
  };
  return s;
}

#define F(member) \
  [](JobConfig & c) -> auto& { return c.member; }
// A mode key's field (ModeKey): the table is its reader and writer.
#define FM(member) \
  [](JobConfig & c) -> auto& { return c.member.Field(ModeKeyGrant::Access()); }
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

const std::vector<KeySpec>& Table() {
  static const std::vector<KeySpec> table = {
      Str("job", "name", F(job.name), "job", "Name used in logs and the summary."),
      Str("job", "output_dir", F(job.output_dir), "output",
          "Where metrics.jsonl, summary.json, trace.json and logs go; relative to the job file. "
          "An existing directory is reused, but not one holding a previous run's metrics."),
      Enum("job", "device", F(job.device), DeviceKind::kAuto, kDeviceNames,
           "Worker backend; auto = cuda when the build has CUDA and a GPU is visible"),
      Int("job", "max_worker_restarts", F(job.max_worker_restarts), 3, 0, 1000000,
          "Replacement workers the launcher starts, over the whole run, for workers that die; the "
          "coordinator re-dispatches the dead worker's unfinished jobs to its replacement, so the "
          "result is unchanged. 0: the first death stops the run (exit code 10)"),
      Float(
          "job", "worker_timeout_s", F(job.worker_timeout_s), 60.0, 0.0, 1e9,
          "A worker that sends nothing (not even its once-a-second heartbeat) for this long is "
          "declared hung: the coordinator kills it and, while restarts remain, its replacement "
          "takes over; else the run stops naming it. 0 = never (rp-launch --debug-worker sets 0)"),
      Float(
          "job", "stopped_timeout_s", F(job.stopped_timeout_s), 600.0, 0.0, 1e9,
          "A worker or coordinator that stops answering because it is stopped (SIGSTOP, Ctrl-Z, a "
          "debugger holding it: state T in /proc) is waited for up to this long, with a log line "
          "every job.worker_timeout_s, and the run goes on unchanged once it continues; past it, "
          "it is treated as hung. 0 = treated as hung at once"),
      Float("job", "device_memory_limit_gib", F(job.device_memory_limit_gib), 0.0, 0.0, 1e6,
            "Caps each CUDA worker's caching allocator at this many GiB (a per-process memory "
            "fraction), and the planner plans for it (schedule.gpu_memory_gb becomes at most 85% "
            "of it, "
            "the rest left for what its estimate leaves out): a smaller card on a larger one. 0 = "
            "the "
            "whole device. CUDA workers only"),
      Float(
          "job", "node_timeout_s", F(job.node_timeout_s), 60.0, 5.0, 86400.0,
          "Several nodes (rp-launch --nnodes): a node whose rp-launch gives no sign of life for "
          "this long (process killed, host gone, network cut) stops every other node, each naming "
          "it; also the bound on the rendezvous and on each cross-node reduction"),

      Str("model", "path", F(model.path), "",
          "Hugging Face model directory (Llama, Qwen2, Qwen3 or Mistral; relative to the job "
          "file), or a model "
          "id (org/name, org/name@revision) in the local Hugging Face cache (HF_HUB_CACHE, "
          "HF_HOME; never "
          "downloaded): its "
          "config.json (docs/model-config.md) replaces the [model] architecture keys and its "
          "safetensors (single or sharded; fp32, bf16 or fp16) are the initial weights"),
      Int("model", "vocab_size", F(model.vocab_size), 256, 2, 1 << 24, "Vocabulary size"),
      Int("model", "hidden_size", F(model.hidden_size), 128, 1, 1 << 20, "Model width"),
      Int("model", "intermediate_size", F(model.intermediate_size), 384, 1, 1 << 22,
          "SwiGLU MLP width"),
      Int("model", "num_layers", F(model.num_layers), 4, 1, 4096, "Decoder blocks"),
      Int("model", "num_heads", F(model.num_heads), 4, 1, 4096, "Query heads"),
      Int("model", "num_kv_heads", F(model.num_kv_heads), 2, 1, 4096,
          "Key/value heads (GQA); must divide num_heads"),
      Int("model", "head_dim", F(model.head_dim), 32, 2, 4096,
          "Per-head width; must be even (RoPE)"),
      Float("model", "rope_theta", F(model.rope.theta), 10000.0, 1.0, 1e12, "RoPE base"),
      Float("model", "rms_norm_eps", F(model.rms_norm_eps), 1e-6, 0.0, 1.0, "RMSNorm epsilon"),
      Bool("model", "qk_norm", F(model.qk_norm), true, "Per-head RMSNorm on q and k (Qwen3)"),
      Bool("model", "tie_embeddings", F(model.tie_embeddings), true,
           "LM head shares the embedding matrix"),
      Float("model", "init_std", F(model.init_std), 0.02, 0.0, 10.0,
            "Std of the normal init of matrices (norm weights start at 1)"),
      Int("model", "num_experts", F(model.moe.num_experts), 0, 0, 1 << 16,
          "Mixture of experts (Qwen3-MoE, model_type qwen3_moe): experts per sparse block; 0 = "
          "every "
          "block has a dense MLP. With model.path, config.json decides (num_experts), as for every "
          "architecture key"),
      Int("model", "experts_per_token", F(model.moe.experts_per_token), 8, 1, 1 << 16,
          "Experts each token is routed to (num_experts_per_tok); at most model.num_experts"),
      Int("model", "expert_intermediate_size", F(model.moe.expert_intermediate_size), 768, 1,
          1 << 22, "Each expert's SwiGLU width (moe_intermediate_size)"),
      Bool("model", "norm_topk_prob", F(model.moe.norm_topk_prob), false,
           "Renormalize the chosen experts' router probabilities to sum to 1 (norm_topk_prob)"),
      Int("model", "sparse_step", F(model.moe.sparse_step), 1, 1, 4096,
          "Every this many blocks is sparse, the others dense (decoder_sparse_step)"),
      Float(
          "model", "router_aux_loss_coef", F(model.moe.aux_loss_weight), 0.0, 0.0, 1e6,
          "Weight of the routers' load-balancing loss in the objective (router_aux_loss_coef with "
          "output_router_logits = true); 0 = not in the objective"),

      Enum("data", "format", F(data.format), DataFormat::kBytes, kFormatNames,
           "bytes: the file at data.path, one token per byte (vocab_size >= 256); "
           "tokens: a flat file of uint16/uint32 token ids with a JSON sidecar <path>.json "
           "{\"dtype\": \"uint16\"|\"uint32\", \"vocab_size\": N}; "
           "jsonl: one {\"input_ids\": [...]} per line, optional \"labels\" (-100 ignored) or "
           "\"loss_mask\" (0/1), records packed into seq_len windows as data.packing says, no "
           "target across records; "
           "random: uniform synthetic tokens from train.seed (benchmarks)"),
      Str("data", "path", F(data.path), "",
          "Corpus for format = bytes, tokens or jsonl; relative to the job file"),
      Int("data", "seq_len", F(data.seq_len), 64, 2, 1 << 20, "Tokens per sequence"),
      Bool("data", "shuffle", F(data.shuffle), true,
           "Visit the corpus windows in a seeded random order each epoch"),
      Str("data", "eval_path", F(data.eval_path), "",
          "Held-out corpus in data.format (relative to the job file) for train.eval_every; "
          "empty = none"),
      Float("data", "eval_fraction", F(data.eval_fraction), 0.0, 0.0, 0.5,
            "Instead of eval_path: hold out this fraction of data.path's windows (the last ones "
            "in file order, at least one), which training then never reads"),
      Enum("data", "packing", F(data.packing), DataPacking::kAuto, kPackingNames,
           "How records share a window. documents: whole records packed into windows, each "
           "attending "
           "only to itself with RoPE positions restarting at its first token (no cross-record "
           "context); pad: one record per window; stream: records concatenated and cut every "
           "seq_len tokens, attention across them (pretraining). auto: documents for jsonl, "
           "stream for bytes, tokens and random"),
      Enum("data", "long_records", F(data.long_records), LongRecords::kSplit, kLongRecordNames,
           "Packing documents or pad: a record longer than seq_len is split into seq_len pieces "
           "(each its own document, positions continuing), truncated to its first seq_len tokens, "
           "or dropped; the counts are logged"),

      Int("train", "steps", F(train.steps), 20, 1, kMax, "Optimizer steps"),
      Float("train", "epochs", F(train.epochs), 0.0, 0.0, 1e6,
            "Instead of train.steps (giving both is refused): passes over data.path's training "
            "windows, fractions allowed; steps = ceil(epochs x windows / sequences per step), "
            "printed by rp-launch --dry-run. The last step of an epoch takes the next epoch's "
            "first windows. 0 = train.steps decides"),
      Int("train", "seed", F(train.seed), 1234, 0, kMax, "Seed of init and data order"),
      Int("train", "microbatches", F(train.microbatches), 3, 1, 4096,
          "M: microbatches per accumulation call (>= GPUs + 1 keeps the pipeline full)"),
      Int("train", "accum_calls", F(train.accum_calls), 2, 1, 4096,
          "K: accumulation calls per optimizer step"),
      Int("train", "microbatch_size", F(train.microbatch_size), 2, 1, 1 << 20,
          "Sequences per microbatch"),
      Int("train", "loss_chunk_tokens", F(train.loss_chunk_tokens), 4096, 1, 1 << 30,
          "Tokens per LM-head + cross-entropy chunk: the head's logits exist for this many "
          "tokens at a time (device memory ~ 2 bytes x chunk x vocabulary in bf16 with the fused "
          "kernels, ~ 14 without)"),
      Int("train", "mlp_tile_tokens", F(train.mlp_tile_tokens), 0, -1, 1 << 30,
          "Tokens per tile of each dense block's MLP (long sequences): the post-attention norm and "
          "the MLP run over the microbatch's tokens this many at a time and a tile's intermediates "
          "are recomputed in the backward instead of kept, so they take ~ 3 x tile x "
          "intermediate_size elements instead of 3 x tokens x intermediate_size, and the normed "
          "sequence is not kept; 0 = the whole microbatch at once; -1 = the "
          "planner chooses the largest tile (untiled, or a power of two >= 512) whose plan fits "
          "schedule.gpu_memory_gb (rp-launch --dry-run and rp-plan print it). The same result up "
          "to rounding; rp-train-ref always runs untiled"),
      Bool("train", "layer_recompute", F(train.layer_recompute), false,
           "Backward stages (and the tail's blocks) first run their layers without autograd, "
           "keeping "
           "only each layer's input, then rebuild and backpropagate one layer's graph at a time: "
           "device memory for one block's intermediates instead of the stage's, for one more "
           "forward per layer. The same result; for long sequences"),
      Enum("train", "dtype", F(train.dtype), TrainDtype::kFp32, kDtypeNames,
           "Compute dtype of the weight copy workers read; masters and moments are fp32. fp16 "
           "scales "
           "the loss dynamically (train.loss_scale_*); CPU workers emulate fp16 and bf16 (fp32 "
           "arithmetic on "
           "weights and stage inputs rounded to the 16-bit type). fp8: bf16, with the blocks' "
           "projections multiplied "
           "in e4m3 with power-of-two scales per row (forward and input gradient; the weight "
           "gradient "
           "stays bf16); CUDA workers on a GPU where LibTorch runs row-scaled e4m3 products (the "
           "worker tries one)"),
      Float("train", "loss_scale_init", F(train.loss_scaling.init), 65536.0, 1e-30, 1e30,
            "fp16: the loss scale of the first step (torch.amp.GradScaler's init_scale)"),
      Float("train", "loss_scale_growth_factor", F(train.loss_scaling.growth_factor), 2.0, 1.0, 1e6,
            "fp16: the scale's multiplier after train.loss_scale_growth_interval finite steps in a "
            "row "
            "(> 1)"),
      Float(
          "train", "loss_scale_backoff_factor", F(train.loss_scaling.backoff_factor), 0.5, 1e-6,
          1.0,
          "fp16: the scale's multiplier after a step whose gradients were not all finite, which is "
          "skipped (< 1)"),
      Int("train", "loss_scale_growth_interval", F(train.loss_scaling.growth_interval), 2000, 1,
          kMax, "fp16: finite steps in a row before the scale grows"),
      Float("train", "grad_clip", F(train.grad_clip), 1.0, 0.0, 1e30,
            "Clip the global gradient L2 norm to this; 0 disables"),
      Int("train", "eval_every", F(train.eval_every), 0, 0, kMax,
          "Compute the eval loss (metrics.jsonl: eval_loss, eval_tokens) after every this many "
          "steps and after the last, with the weights after that step's update; needs "
          "data.eval_path or data.eval_fraction (data.format = \"random\": a held-out synthetic "
          "stream); 0 = never"),
      Int("train", "eval_microbatches", F(train.eval_microbatches), 4, 1, 1 << 20,
          "Size of the eval set in microbatches of train.microbatch_size sequences: the first "
          "windows of the eval data in file order, the same set at every evaluation"),
      Int("train", "stop_after", F(train.stop_after), 0, 0, kMax,
          "Stop once this many steps are done, after writing a checkpoint (for time-limited "
          "allocations; rp-launch --resume continues); 0 = run to train.steps"),

      Enum("optimizer", "name", F(optimizer.name), OptimizerName::kAdamW, kOptimizerNames,
           "adamw: decoupled weight decay, bias correction (state m, v); sgd: momentum with "
           "coupled weight decay as torch.optim.SGD (state: one momentum buffer)"),
      Enum("optimizer", "mode", FM(optimizer.mode), OptimizerMode::kExact, kModeNames,
           "exact: step t+1 reads weights holding step t's update (synchronous semantics); stale1: "
           "step t+1 reads the weights before step t's update, which then overlaps all of step t+1 "
           "(the published asynchronous mode; one more bf16/fp32 weight copy in host memory)"),
      Enum("optimizer", "state", FM(optimizer.state), OptimizerState::kReplicated, kStateNames,
           "Several nodes (rp-launch --nnodes N): replicated: every node keeps the whole optimizer "
           "state and makes the whole update; sharded: each node keeps the fp32 masters and "
           "moments of 1/N of every parameter and updates only those, and the workers gather the "
           "updated shares across the nodes before a layer is fetched (ZeRO-1 across nodes: host "
           "bytes per parameter fall with N; the same results bit for bit). Training checkpoints "
           "are then written by every node into the one checkpoint directory, which the nodes "
           "must share; they resume on any node count. One node: no difference"),
      Float("optimizer", "lr", F(optimizer.lr), 3e-3, 0.0, 10.0, "Peak learning rate"),
      Float("optimizer", "min_lr", F(optimizer.min_lr), 3e-4, 0.0, 10.0,
            "Learning rate at the last step of the cosine or linear schedule"),
      Enum("optimizer", "lr_schedule", F(optimizer.lr_schedule), LrSchedule::kCosine,
           kLrScheduleNames,
           "After warmup: cosine (half a cosine from lr down to min_lr at the last step), linear "
           "(a line from lr down to min_lr at the last step; min_lr = 0 is Hugging Face's "
           "\"linear\") or constant (lr throughout)"),
      Int("optimizer", "warmup_steps", F(optimizer.warmup_steps), 2, 0, kMax,
          "Linear warmup steps before the schedule (step t of the warmup runs at lr x (t+1) / "
          "warmup_steps)"),
      Float("optimizer", "warmup_ratio", F(optimizer.warmup_ratio), 0.0, 0.0, 1.0,
            "Instead of warmup_steps (giving both is refused): warmup_steps = ceil(warmup_ratio x "
            "train.steps), as Hugging Face's warmup_ratio; 0 = warmup_steps decides"),
      Float("optimizer", "weight_decay", F(optimizer.weight_decay), 0.1, 0.0, 10.0,
            "Decoupled weight decay (applied to matrices, not to norm weights)"),
      Float("optimizer", "beta1", F(optimizer.beta1), 0.9, 0.0, 0.999999, "Adam beta1"),
      Float("optimizer", "beta2", F(optimizer.beta2), 0.95, 0.0, 0.9999999, "Adam beta2"),
      Float("optimizer", "eps", F(optimizer.eps), 1e-8, 0.0, 1.0, "Adam epsilon"),
      Float("optimizer", "momentum", F(optimizer.momentum), 0.9, 0.0, 0.999999, "SGD momentum"),
      Enum(
          "optimizer", "gradients_wait_in", FM(optimizer.gradients_wait_in), GradientsWait::kHost,
          kGradientsWaitNames,
          "With clipping, where a step's gradients wait for its global norm. host: in the host's "
          "gradient arena (4 bytes per parameter of host memory: every gradient is held). workers: "
          "on the workers that computed them (device memory), which report their squared sums; the "
          "commits follow the norm and stream through an arena sized as without clipping, and the "
          "next step's activations take a second set of host slots (its forward then starts behind "
          "the first layers' updates instead of the last commit). workers needs train.grad_clip > "
          "0, one accumulation round per step, no tied embedding (unless LoRA freezes it) and one "
          "node"),
      Bool(
          "optimizer", "speculative_update", FM(optimizer.speculative_update), false,
          "Exact mode with clipping: while the backward runs, write each parameter's next weights "
          "as "
          "if the step were not clipped, into a second buffer (2 bytes per parameter of host "
          "memory, "
          "4 where workers fetch the fp32 masters). A step whose norm stays at or under "
          "train.grad_clip then starts the next step's forward at once instead of behind the "
          "updates; a clipped step runs its update again, as without the key, and speculation "
          "pauses "
          "until a step is unclipped. The same bits either way. For jobs whose steps are mostly "
          "unclipped. Needs adamw, train.grad_clip > 0, optimizer.gradients_wait_in = \"host\" and "
          "no fp16"),
      Int("optimizer", "device_update_blocks", FM(optimizer.device_update_blocks), 0, 0, 4096,
          "Exact mode with clipping: blocks 1..N are also updated on the worker's GPU at each step "
          "boundary (the same bits as the host's update), and the next step's forward uses those "
          "weights at once while the host updates the other blocks first. The worker reads the "
          "blocks' masters and moments (12 bytes per parameter, read-only from host shared memory) "
          "while the backward runs and keeps them, their gradients and the new weights on "
          "the device: about 18 bytes per covered parameter of device memory. 0 = off. Needs "
          "adamw, "
          "train.grad_clip > 0, train.dtype = \"bf16\" or \"fp32\", one accumulation round per "
          "step, "
          "one worker and one node, and no speculative_update or LoRA"),
      Int("optimizer", "update_passes", FM(optimizer.update_passes), kUpdatePassesAuto, 0, 2,
          "Exact mode where the gradient arena holds every gradient (clipping, fp16 or "
          "train.accum_calls > 1, unless gradients wait in the workers): 2 splits each update "
          "into a first pass that writes only what workers fetch, which the next step's forward "
          "waits for, and a second that writes the moments while that forward runs; 1 updates in "
          "one pass, about a third fewer bytes of host memory traffic in all, for jobs whose "
          "CPU optimizer bounds the step. The same bits either way. 0 = auto: the planner "
          "simulates "
          "both and keeps the faster (rp-plan and rp-launch --dry-run print the choice); stale1 "
          "and a streamed arena always update in one pass, and 2 is refused there"),
      Int("optimizer", "grad_buffer_mb", F(optimizer.grad_buffer_mb), 0, 0, int64_t{1} << 30,
          "Host gradient arena in MiB; 0 = auto: every gradient when train.grad_clip > 0, "
          "train.dtype = \"fp16\" or train.accum_calls > 1 (each must be held until the step's "
          "last commit or the global "
          "norm), else twice the largest stage's gradients, so gradients are streamed: a layer's "
          "buffer is reused as soon as its update is done. Smaller than the job needs is an error"),

      Int("lora", "rank", F(lora.rank), 0, 0, 65536,
          "LoRA rank r; 0 = full fine-tuning. With r > 0 only the adapters train (masters, "
          "moments, "
          "gradients); the base weights stay frozen as the compute copy alone"),
      Float("lora", "alpha", F(lora.alpha), 8.0, 0.0, 1e9,
            "LoRA alpha: the adapter's output is scaled by alpha / rank (PEFT's lora_alpha)"),
      Float("lora", "dropout", F(lora.dropout), 0.0, 0.0, 0.99,
            "Dropout on the adapter's input (PEFT's lora_dropout); the mask is a pure function of "
            "(seed, step, call, microbatch, layer, module), so recompute and rp-train-ref see the "
            "same one"),
      StrArray("lora", "target_modules", F(lora.target_modules), "[\"q_proj\", \"v_proj\"]",
               "Projections that get adapters, by PEFT's names: q_proj, k_proj, v_proj, o_proj, "
               "gate_proj, up_proj, down_proj; may be empty when lora.target_parameters is not"),
      StrArray(
          "lora", "target_parameters", F(lora.target_parameters), "[]",
          "Mixture-of-experts tensors that get adapters, by PEFT's target_parameters names: "
          "mlp.experts.gate_up_proj, mlp.experts.down_proj (or a suffix after a dot, as PEFT "
          "matches). One adapter per tensor covers every "
          "expert (PEFT's layout: lora_A [r x experts, in] expert-major, lora_B [out, r x experts] "
          "rank-major); needs lora.dropout = 0, as PEFT"),
      Str("lora", "init_from", F(lora.init_from), "",
          "PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from, "
          "relative to the job file; its rank and targets must equal this job's; empty = A "
          "uniform(+-1/sqrt(in)), B zero (PEFT's init)"),
      Str("lora", "export", F(lora.export_dir), "adapter",
          "After the last step, write the adapters in PEFT's layout (adapter_config.json + "
          "adapter_model.safetensors) here, relative to job.output_dir; empty = no export. "
          "checkpoint.export_hf then writes the merged model (W + alpha/rank * B A)"),

      Int("schedule", "forward_stages", F(schedule.forward_stages), 2, 1, 4096,
          "Forward stages, equal layer counts (ignored when forward_cuts is set)"),
      Int("schedule", "backward_stages", F(schedule.backward_stages), 2, 1, 4096,
          "Backward stages after the fused tail, equal layer counts (ignored when backward_cuts is "
          "set)"),
      Int("schedule", "tail_blocks", F(schedule.tail_blocks), 0, 0, 4096,
          "Decoder blocks fused into the tail stage (forward + loss + backward, no recompute)"),
      Int("schedule", "keep_attention", F(schedule.keep_attention), 0, -1, 4096,
          "Recomputed decoder blocks, the ones just below the kept blocks or the fused tail, "
          "whose attention output and the log-sum-exp of its rows stay on the device from the "
          "block's forward stage to its backward stage, whose recompute then runs the attention "
          "kernel's backward on them instead of its forward again: device memory for one "
          "hidden-sized tensor per block and microbatch of a round, for a faster backward where "
          "attention dominates (long sequences). -1: as many as let the plan fit "
          "schedule.gpu_memory_gb by the planner's estimate (rp-launch --dry-run and rp-plan print "
          "the count). Needs --gpus 1 (the records stay in the worker that ran the forward; a "
          "replaced worker recomputes them). Any count runs every block's attention through "
          "kernels that return the log-sum-exp (on CUDA the kernel SDPA picks, the same values); "
          "rp-train-ref uses the same kernels"),
      Int("schedule", "kept_blocks", F(schedule.kept_blocks), 0, -1, 4096,
          "Decoder blocks just before the fused tail whose forward keeps its graph (the "
          "activations the backward needs) on the device until their backward stage, which then "
          "does not recompute them: device memory for every microbatch's activations of these "
          "blocks for a whole round, for a faster backward. Needs --gpus 1 (the graphs stay in the "
          "worker that ran the forward; a replaced worker recomputes from the checkpoints); not "
          "with train.layer_recompute, tiled MLPs or mixture-of-experts blocks. -1: as many as let "
          "the plan fit "
          "schedule.gpu_memory_gb by the planner's estimate (rp-launch --dry-run and rp-plan print "
          "the number), none with several workers"),
      Bool("schedule", "frozen_on_device", FM(schedule.frozen_on_device), false,
           "LoRA: every worker copies the whole frozen base to its device at its first fetch and "
           "keeps it, so its jobs copy only the adapters over the host link. Costs the whole base "
           "in the compute dtype on each worker's device (rp-plan prints it); exact mode's next "
           "forward then no longer waits for the base to stream in behind the update. Needs "
           "lora.rank > 0 and, with CUDA workers, one worker per GPU; rp-plan and rp-launch "
           "--dry-run "
           "print its prediction when it would be faster"),
      IntArray("schedule", "forward_cuts", F(schedule.forward_cuts),
               "Explicit first layers of forward stages 2.. (ascending; layer 0 = embedding, "
               "1..num_layers = blocks)"),
      IntArray("schedule", "backward_cuts", F(schedule.backward_cuts),
               "Explicit first layers of the non-tail backward stages except the one at 0 "
               "(ascending)"),
      Enum("schedule", "activations", FM(schedule.activations), Activations::kHost,
           kActivationNames,
           "Where hidden states (stage outputs, recompute checkpoints) and input gradients live "
           "between stages. host: shared-memory slots (any number of workers; a replaced worker "
           "re-runs its jobs from them). worker: in the worker's own (device) memory, with no "
           "copies to or from the host and no host memory for them; needs --gpus 1, and a "
           "worker that dies stops the run (resume from the last checkpoint). cuda_ipc: each "
           "worker keeps what it produces in one device-memory pool exported once through CUDA "
           "IPC, and the consumer copies it device to device (same GPU, or peer to peer between "
           "GPUs that can map each other's memory); no host memory for activations, one pool of "
           "the slots' size per worker in device memory, and a worker that dies stops the run. "
           "CPU workers stand in with a named shared-memory pool per worker (the same protocol, "
           "what CI tests)"),
      Enum("schedule", "weights_source", FM(schedule.weights_source), WeightsSource::kAuto,
           kWeightsNames,
           "What workers fetch a layer's weights from. auto: in exact mode the fp32 masters "
           "themselves, rounded to train.dtype on the worker (no host compute copy: 2 bytes per "
           "parameter less host memory in bf16, 4 in fp32, and no copy for the optimizer to "
           "write; twice the weight bytes over the host link in bf16); in stale1, which must keep "
           "the previous version readable while the masters change, a compute copy. "
           "compute_copy: always a separate copy in train.dtype that the optimizer writes"),
      Enum("schedule", "embedding_lookup", FM(schedule.embedding_lookup), EmbeddingLookup::kAuto,
           kLookupNames,
           "How a stage with the embedding gets the rows it looks up. auto, where workers fetch "
           "the masters (schedule.weights_source) and the embedding is trained: its lookup reads "
           "the rows of its tokens straight from the fp32 masters in host memory (mapped, no copy "
           "of the whole table), and in exact mode with clipping the optimizer updates the rows "
           "of the next step's tokens first, so the next step's first stage starts before the "
           "rest of the table is updated (each row's update is the same computation; in bf16 the "
           "lookup's weight gradient is summed in fp32 instead of bf16, so bf16 runs differ from "
           "copy in the last bits, fp32 runs not at all). copy: the whole table is copied to the "
           "device once its update is complete"),
      Enum("schedule", "partition", FM(schedule.partition), Partition::kEqual, kPartitionNames,
           "equal: forward_stages/backward_stages (or explicit cuts); auto: the planner picks the "
           "tail size (up to 3 blocks; with schedule.gpu_memory_gb, up to every block, beyond 8 in "
           "steps "
           "of about a third) "
           "and both partitions minimizing the simulated step time (from the measured "
           "profile when there is one, else a FLOP cost model; rp-plan shows its choice); where no "
           "split into a few stages fits schedule.gpu_memory_gb, finer ones, down to a block per "
           "stage"),
      Str("schedule", "profile", F(schedule.profile), "",
          "Measured profile (profile.json) the auto planner uses; empty: rp-launch uses "
          "<output_dir>/profile.json when it exists and matches the workload, else the FLOP "
          "cost model"),
      Int("schedule", "profile_steps", F(schedule.profile_steps), 2, 0, kMax,
          "Steps whose layers are timed (after one warm-up step) to write "
          "<output_dir>/profile.json "
          "and the step-time prediction; 0 = no profiling"),
      Float("schedule", "replan_gain", F(schedule.replan_gain), 0.05, 0.0, 1.0,
            "With partition = auto: when a fresh profile makes the planner predict a step this "
            "much faster (fraction) with another plan, the run checkpoints and rp-launch restarts "
            "it on the new plan (resume is exact); 0 = never re-plan"),
      Float("schedule", "drift", F(schedule.drift), 0.2, 0.0, 100.0,
            "After profiling, measured step times off the prediction by more than this fraction "
            "for 3 steps in a row trigger a new profile (and a re-plan check); 0 = never"),
      Float("schedule", "node_link_gb_s", F(schedule.node_link_gb_s), 10.0, 0.0, 1e6,
            "Several nodes: the bandwidth between nodes (GB/s, each direction) the planner and "
            "rp-plan "
            "--nnodes assume for the cross-node gradient sums; 0 = free"),
      Float(
          "schedule", "gpu_memory_gb", F(schedule.gpu_memory_gb), 0.0, 0.0, 1e6,
          "Per-worker memory limit the auto planner, train.mlp_tile_tokens = -1 and "
          "schedule.kept_blocks = -1 respect, against the planner's estimate of the "
          "tensors allocated at the peak (rp-plan prints its parts; measured on the H200: 1.7B "
          "job +25-28%, 4B job -1%); leave room for the CUDA context and the allocator's cache "
          "(~1-2 GB); 0 = for CUDA workers, 85% of the smallest visible GPU's memory as nvidia-smi "
          "reports it to rp-launch (unlimited where it reports none)"),
      Float("schedule", "host_memory_gb", F(schedule.host_memory_gb), 0.0, 0.0, 1e6,
            "Shared memory (/dev/shm: weights, optimizer state, the gradient arena and the "
            "activation slots) the auto planner's plan may take, in GB: a backward stage's first "
            "block keeps its checkpoint in a host slot (one per microbatch, twice over where "
            "consecutive steps overlap), so under this limit the planner recomputes across more "
            "blocks per stage instead (rp-plan prints the shared memory of its plan; --max-seq "
            "plans for --host-memory-gb); with partition = equal, a plan over it is refused; "
            "0 = the plan ignores host memory (rp-launch still refuses segments larger than "
            "/dev/shm)"),

      Int("checkpoint", "every", F(checkpoint.every), 0, 0, kMax,
          "Write a training-state checkpoint (step-N.rpstate: masters, moments, compute copies) "
          "every this many steps and after the last; 0 = only when train.stop_after stops the run. "
          "rp-launch --resume continues from the newest one with identical results"),
      Str("checkpoint", "export_hf", F(checkpoint.export_hf), "",
          "After the last step, write the trained model as a Hugging Face directory (config.json + "
          "model.safetensors in checkpoint.export_dtype, with the base's tokenizer files, "
          "generation_config.json and special-token ids) here, relative to job.output_dir; empty = "
          "no export"),
      Int("checkpoint", "export_shard_mb", F(checkpoint.export_shard_mb), 5000, 0, 1 << 30,
          "Largest safetensors file of export_hf in MiB: a bigger model is written as shards "
          "model-0000i-of-0000N.safetensors with model.safetensors.index.json; 0 = one file"),
      Enum("checkpoint", "export_dtype", F(checkpoint.export_dtype), ExportDtype::kAuto,
           kExportDtypeNames,
           "Tensors of checkpoint.export_hf (rounded to nearest even from the fp32 masters). auto: "
           "the base's dtype as its config.json names it (bfloat16 for the published Qwen3 and "
           "Llama checkpoints), float32 without a base"),
      Int("checkpoint", "export_every", F(checkpoint.export_every), 0, 0, kMax,
          "Also write the exports after every this many steps, into <export_hf>-step-<N> and "
          "<lora.export>-step-<N> (training pauses while they are written); 0 = only after the "
          "last step"),
      Str("checkpoint", "dir", F(checkpoint.dir), "checkpoints",
          "Checkpoint directory, relative to job.output_dir"),
      Int("checkpoint", "keep", F(checkpoint.keep), 2, 1, 1000000,
          "Newest training-state checkpoints kept; older ones are deleted after a new one is "
          "safely on disk"),
      Float("checkpoint", "memory_gb", F(checkpoint.memory_gb), -1.0, -1.0, 1e6,
            "Host memory (GB) that periodic checkpoints' copies of the training state may take, so "
            "they are written while training goes on: two whole copies where they fit, else one, "
            "else one partial copy: the parameters updated first are copied and the rest are "
            "written from the live state in update order, each one's next update waiting until "
            "its bytes are in the file (the same file and bits either way; never slower than "
            "writing on the loop). -1 = from the host's available memory (whole copies with a "
            "quarter to spare, else half of it); 0 = nothing copied. Sharded state (several "
            "nodes) is copied whole or written on the loop"),

      Bool("metrics", "trace", F(metrics.trace), true, "Write trace.json (Chrome/Perfetto format)"),
      Bool("metrics", "tensorboard", F(metrics.tensorboard), true,
           "Write each step's scalars (loss, eval loss, lr, grad norm, tokens/s, step time, "
           "bubble, loss scale, "
           "H2D GB/s, device and host memory) as TensorBoard event files under OUTPUT/tb"),
  };
  return table;
}
#undef F
#undef FM

std::string Join(const std::string& dir, const std::string& p) {
  if (p.empty()) return p;
  fs::path path(p);
  if (path.is_absolute()) return path.lexically_normal().string();
  return (fs::path(dir) / path).lexically_normal().string();
}

// BenchKnobs from the environment; a value that does not parse is an error naming the variable.
Status ReadBenchKnobs(BenchKnobs* k) {
  auto text = [](const char* var) -> std::optional<std::string> {
    auto v = EnvironmentValue(var);
    if (!v || v->empty()) return std::nullopt;
    return v;
  };
  auto flag = [&](const char* var, bool* out) -> Status {
    auto v = text(var);
    if (!v) return Status::Ok();
    if (*v != "0" && *v != "1")
      return Status::InvalidArgument(std::string(var) + ": must be 0 or 1, got \"" + *v + "\"");
    *out = *v == "1";
    return Status::Ok();
  };
  auto count = [&](const char* var, int64_t* out) -> Status {
    auto v = text(var);
    if (!v) return Status::Ok();
    char* end = nullptr;
    const long long n = std::strtoll(v->c_str(), &end, 10);
    if (*end != '\0' || n < 0 || n > 4096)
      return Status::InvalidArgument(std::string(var) +
                                     ": must be an integer in [0, 4096], got \"" + *v + "\"");
    *out = n;
    return Status::Ok();
  };
  auto tristate = [&](const char* var, Tristate* out) -> Status {
    auto v = text(var);
    if (!v) return Status::Ok();
    RP_ASSIGN_OR_RETURN(*out, ParseEnum(kTristateNames, *v, var));
    return Status::Ok();
  };
  RP_RETURN_IF_ERROR(flag("RP_INTERLEAVE_CALLS", &k->interleave_calls));
  RP_RETURN_IF_ERROR(tristate("RP_MERGE_CALLS", &k->merge_calls));
  RP_RETURN_IF_ERROR(tristate("RP_LAYER_MAJOR_FORWARD", &k->layer_major_forward));
  RP_RETURN_IF_ERROR(flag("RP_FUSED_KERNELS", &k->fused_kernels));
  RP_RETURN_IF_ERROR(flag("RP_FUSED_NORMS", &k->fused_norms));
  RP_RETURN_IF_ERROR(flag("RP_GROUPED_EXPERTS", &k->grouped_experts));
  RP_RETURN_IF_ERROR(count("RP_OPTIMIZER_THREADS", &k->optimizer_threads));
  return count("RP_OPTIMIZER_REST_THREADS", &k->optimizer_rest_threads);
}

StatusOr<toml::table> ParseText(const std::string& text, const std::string& origin) {
  try {
    return toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    std::ostringstream m;
    m << origin << ":" << e.source().begin.line << ":" << e.source().begin.column
      << ": TOML syntax error: " << e.description();
    return Status::InvalidArgument(m.str());
  }
}

Status ApplyOverride(toml::table& root, const std::string& assignment) {
  auto eq = assignment.find('=');
  auto dot = assignment.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq) {
    // A key without its section: name the section it belongs to.
    if (eq != std::string::npos && (dot == std::string::npos || dot > eq)) {
      const std::string key = assignment.substr(0, eq);
      for (const auto& s : Table())
        if (s.doc.key == key)
          return Status::InvalidArgument("--set " + assignment +
                                         ": expected section.key=value; did you mean --set " +
                                         s.doc.section + "." + assignment + "?");
    }
    return Status::InvalidArgument("--set " + assignment +
                                   ": expected section.key=value (for example train.steps=5)");
  }
  std::string section = assignment.substr(0, dot);
  std::string key = assignment.substr(dot + 1, eq - dot - 1);
  std::string value = assignment.substr(eq + 1);
  if (section.empty() || key.empty())
    return Status::InvalidArgument("--set " + assignment + ": empty section or key");
  // The value is TOML (5, 1e-3, true, "x", [1, 2]); anything that does not parse is a string.
  toml::table snippet;
  try {
    snippet = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    snippet.insert_or_assign("v", value);
  }
  toml::table* sec = root[section].as_table();
  if (!sec) {
    root.insert_or_assign(section, toml::table{});
    sec = root[section].as_table();
  }
  sec->insert_or_assign(key, *snippet.get("v"));
  return Status::Ok();
}

}  // namespace

bool SparseBlock(const ModelConfig& m, int64_t block) {
  const auto& dense = m.moe.dense_layers;
  return m.moe.num_experts > 0 && (block + 1) % m.moe.sparse_step == 0 &&
         std::find(dense.begin(), dense.end(), block) == dense.end();
}

int64_t SparseBlocksBefore(const ModelConfig& m, int64_t block) {
  int64_t n = 0;
  for (int64_t b = 0; b < block; ++b) n += SparseBlock(m, b) ? 1 : 0;
  return n;
}

const std::vector<std::string>& LoraTargetableModules() {
  static const std::vector<std::string> modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"};
  return modules;
}

const std::vector<std::string>& LoraTargetableParameters() {
  static const std::vector<std::string> tensors = {"mlp.experts.gate_up_proj",
                                                   "mlp.experts.down_proj"};
  return tensors;
}

std::string CanonicalLoraParameter(const std::string& name) {
  for (const auto& full : LoraTargetableParameters())
    if (full == name || (full.size() > name.size() &&
                         full.compare(full.size() - name.size(), name.size(), name) == 0 &&
                         full[full.size() - name.size() - 1] == '.'))
      return full;
  return "";
}

std::vector<KeyDoc> DocumentedKeys() {
  std::vector<KeyDoc> out;
  for (auto& s : Table()) out.push_back(s.doc);
  return out;
}

namespace {
// Every key of the table with its value in `config`, as JobToml writes them.
toml::table ResolvedTable(const JobConfig& config) {
  JobConfig c = config;  // the getters take the fields by reference
  const bool from_checkpoint = !c.model.path.empty();
  toml::table root;
  for (const auto& s : Table()) {
    const std::string name = s.doc.section + "." + s.doc.key;
    if (from_checkpoint && s.doc.section == "model" && s.doc.key != "path" &&
        s.doc.key != "init_std")
      continue;
    // A dense model's expert keys hold nothing (0) once resolved: left to their defaults.
    if (c.model.moe.num_experts == 0 && s.doc.section == "model" && ExpertSettingKey(s.doc.key))
      continue;
    if (name == "train.steps" && c.train.epochs > 0) continue;
    if (name == "optimizer.warmup_steps" && c.optimizer.warmup_ratio > 0) continue;
    if (!root.contains(s.doc.section)) root.insert_or_assign(s.doc.section, toml::table{});
    s.get(c, *root[s.doc.section].as_table(), s.doc.key);
  }
  return root;
}

// The shortest decimal that reads back as `v`: positional (600, 0.003) between 1e-4 and 1e15,
// with an exponent (1e-06) outside.
std::string ShortestDecimal(double v) {
  char buf[64];
  const double magnitude = std::fabs(v);
  const bool positional = magnitude == 0.0 || (magnitude >= 1e-4 && magnitude < 1e15);
  for (int digits = positional ? 0 : 1; digits <= 24; ++digits) {
    std::snprintf(buf, sizeof(buf), positional ? "%.*f" : "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// The keys of the run-defining sections that do not decide the trajectory: its length and
// cadence, where its files are, how fast it goes and where the optimizer state lives (sharded
// across nodes or replicated: the same bits).
bool LeavesTrajectoryAlone(const std::string& name) {
  static const char* const kKeys[] = {"model.path",
                                      "data.eval_path",
                                      "train.steps",
                                      "train.epochs",
                                      "train.stop_after",
                                      "train.eval_every",
                                      "train.eval_microbatches",
                                      "train.loss_chunk_tokens",
                                      "train.mlp_tile_tokens",
                                      "train.layer_recompute",
                                      "optimizer.gradients_wait_in",
                                      "optimizer.speculative_update",
                                      "optimizer.device_update_blocks",
                                      "optimizer.update_passes",
                                      "optimizer.grad_buffer_mb",
                                      "optimizer.state",
                                      "lora.export"};
  return std::find(std::begin(kKeys), std::end(kKeys), name) != std::end(kKeys);
}
}  // namespace

RunRecord RunDefiningValues(const JobConfig& config) {
  RunRecord out;
  const toml::table root = ResolvedTable(config);
  for (const char* section : {"model", "data", "train", "optimizer", "lora"}) {
    const toml::table* t = root[section].as_table();
    if (t == nullptr) continue;
    for (const auto& [key, node] : *t) {
      const std::string name = std::string(section) + "." + std::string(key.str());
      if (LeavesTrajectoryAlone(name)) continue;
      std::ostringstream value;
      if (auto f = node.value_exact<double>()) {
        value << ShortestDecimal(*f);  // 0.003, not 0.0030000000000000001
      } else {
        node.visit([&value](const auto& v) { value << v; });
      }
      out[name] = value.str();
    }
  }
  // The data by name and size, not by path: a run directory and its data may move.
  if (!config.data.path.empty()) {
    std::error_code ec;
    const auto bytes = fs::file_size(config.data.path, ec);
    out["data.path"] = fs::path(config.data.path).filename().string() +
                       (ec ? std::string() : " (" + std::to_string(bytes) + " bytes)");
  }
  return out;
}

std::vector<std::string> RunDifferences(const RunRecord& checkpoint, const RunRecord& job) {
  std::vector<std::string> out;
  auto said = [](const RunRecord& r, const std::string& k) {
    auto it = r.find(k);
    return it == r.end() ? std::string("(not set)") : it->second;
  };
  std::vector<std::string> keys;
  for (const auto& [k, v] : checkpoint) keys.push_back(k);
  for (const auto& [k, v] : job)
    if (!checkpoint.count(k)) keys.push_back(k);
  std::sort(keys.begin(), keys.end());
  for (const auto& k : keys)
    if (said(checkpoint, k) != said(job, k))
      out.push_back(k + " " + said(checkpoint, k) + " there, " + said(job, k) + " here");
  return out;
}

std::string JobToml(const JobConfig& config) {
  const toml::table root = ResolvedTable(config);
  std::ostringstream text;
  text << toml::toml_formatter(root);
  // toml++ writes every float with 17 significant digits (lr = 0.0030000000000000001); each is
  // written as the shortest decimal that reads back as the same double, still a TOML float.
  static const std::regex kFloatLine(
      R"(^(\s*[A-Za-z0-9_]+ = )([-+]?[0-9]+(\.[0-9]+)?(e[-+]?[0-9]+)?)$)");
  std::ostringstream out;
  out << "# The job as rp-launch resolved it: every key, defaults included (paths absolute).\n"
         "# Loadable as a job file; rp-launch --resume DIR reads the copy in the run's "
         "directory.\n\n";
  std::istringstream lines(text.str());
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, kFloatLine) && (m[3].matched || m[4].matched)) {
      std::string shortest = ShortestDecimal(std::strtod(m[2].str().c_str(), nullptr));
      if (shortest.find_first_of(".e") == std::string::npos) shortest += ".0";
      line = m[1].str() + shortest;
    }
    out << line << "\n";
  }
  return out.str();
}

const char* EnumName(DeviceKind v) { return NameIn(kDeviceNames, v); }
const char* EnumName(DataFormat v) { return NameIn(kFormatNames, v); }
const char* EnumName(DataPacking v) { return NameIn(kPackingNames, v); }
const char* EnumName(LongRecords v) { return NameIn(kLongRecordNames, v); }
const char* EnumName(TrainDtype v) { return NameIn(kDtypeNames, v); }
const char* EnumName(OptimizerName v) { return NameIn(kOptimizerNames, v); }
const char* EnumName(OptimizerMode v) { return NameIn(kModeNames, v); }
const char* EnumName(OptimizerState v) { return NameIn(kStateNames, v); }
const char* EnumName(LrSchedule v) { return NameIn(kLrScheduleNames, v); }
const char* EnumName(ExportDtype v) { return NameIn(kExportDtypeNames, v); }
const char* EnumName(GradientsWait v) { return NameIn(kGradientsWaitNames, v); }
const char* EnumName(Activations v) { return NameIn(kActivationNames, v); }
const char* EnumName(WeightsSource v) { return NameIn(kWeightsNames, v); }
const char* EnumName(EmbeddingLookup v) { return NameIn(kLookupNames, v); }
const char* EnumName(Partition v) { return NameIn(kPartitionNames, v); }
const char* EnumName(Tristate v) { return NameIn(kTristateNames, v); }

bool TokenFileHasDocuments(const std::string& path) {
  std::ifstream in(path + ".json");
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  const auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("documents");
}

void ResolveWarmup(JobConfig* c) {
  if (c->optimizer.warmup_ratio > 0)
    c->optimizer.warmup_steps = static_cast<int64_t>(
        std::ceil(c->optimizer.warmup_ratio * static_cast<double>(c->train.steps) - 1e-9));
}

Status CheckModelValue(const std::string& key, double value, const std::string& name) {
  for (const auto& s : Table()) {
    if (s.doc.section != "model" || s.doc.key != key) continue;
    JobConfig scratch;
    if (s.doc.type == "int")
      return s.set(toml::value<int64_t>(static_cast<int64_t>(value)), scratch, name);
    return s.set(toml::value<double>(value), scratch, name);
  }
  return Status::Internal("CheckModelValue: model." + key + " is not a numeric job key");
}

namespace {

// The names of Hugging Face's Trainer, TRL and PEFT arguments that a job file spells otherwise.
const std::vector<std::pair<const char*, const char*>> kPeerNames = {
    {"learning_rate", "optimizer.lr"},
    {"lr_scheduler_type", "optimizer.lr_schedule"},
    {"warmup_ratio", "optimizer.warmup_ratio"},
    {"num_train_epochs", "train.epochs"},
    {"max_steps", "train.steps"},
    {"per_device_train_batch_size", "train.microbatch_size"},
    {"gradient_accumulation_steps", "train.accum_calls"},
    {"max_grad_norm", "train.grad_clip"},
    {"max_seq_length", "data.seq_len"},
    {"max_length", "data.seq_len"},
    {"packing", "data.packing"},
    {"eval_steps", "train.eval_every"},
    {"save_steps", "checkpoint.every"},
    {"save_total_limit", "checkpoint.keep"},
    {"output_dir", "job.output_dir"},
    {"r", "lora.rank"},
    {"lora_r", "lora.rank"},
    {"lora_alpha", "lora.alpha"},
    {"lora_dropout", "lora.dropout"},
    {"model_name_or_path", "model.path"},
    {"bf16", "train.dtype"},
    {"fp16", "train.dtype"},
};

// "; did you mean X?" for the known key a mistyped one most likely meant: the same key in another
// section, the job key of a Trainer/TRL/PEFT argument name, else the closest section.key; "" when
// none is close.
std::string Suggestion(const std::vector<KeySpec>& table, const std::string& section,
                       const std::string& key) {
  std::vector<std::string> names;
  for (const auto& s : table) {
    if (s.doc.key == key) return "; did you mean " + s.doc.section + "." + s.doc.key + "?";
    names.push_back(s.doc.section + "." + s.doc.key);
  }
  for (const auto& [peer, ours] : kPeerNames)
    if (key == peer) return std::string("; did you mean ") + ours + "?";
  const std::string best = ClosestMatch(section + "." + key, names);
  return best.empty() ? "" : "; did you mean " + best + "?";
}

// With model.path, config.json decides the architecture: a [model] key the job gives must say
// what config.json says, or the job is refused naming both (never silently replaced).
template <typename Given, typename Named>
Status CheckModelKeysAgree(JobConfig as_given, JobConfig resolved, const Given& given,
                           const Named& named) {
  const bool dense = resolved.model.moe.num_experts == 0;
  for (const auto& s : Table()) {
    if (s.doc.section != "model" || s.doc.key == "path" || s.doc.key == "init_std") continue;
    if (!given("model", s.doc.key.c_str())) continue;
    // A dense checkpoint has no expert settings to disagree with.
    if (dense && ExpertSettingKey(s.doc.key)) continue;
    toml::table mine, theirs;
    s.get(as_given, mine, s.doc.key);
    s.get(resolved, theirs, s.doc.key);
    if (mine == theirs) continue;
    std::ostringstream m;
    m << named("model." + s.doc.key) << " = " << toml::toml_formatter(*mine.get(s.doc.key))
      << " and model.path: " << resolved.model.path << "/config.json gives "
      << toml::toml_formatter(*theirs.get(s.doc.key))
      << "; a checkpoint's config.json decides the architecture, so remove model." << s.doc.key
      << " (or leave model.path out to build the model from the job's keys)";
    return Status::InvalidArgument(m.str());
  }
  return Status::Ok();
}

}  // namespace

StatusOr<JobConfig> ParseJobConfigBeforeCrossChecks(const std::string& toml_text,
                                                    const std::string& base_dir,
                                                    const std::vector<std::string>& overrides,
                                                    const HostFacts& host) {
  RP_ASSIGN_OR_RETURN(toml::table root, ParseText(toml_text, base_dir + "/<job>"));
  // Keys given by --set are named as such in errors (LoadJobConfig then names no file).
  std::set<std::string> from_set;
  for (auto& o : overrides) {
    RP_RETURN_IF_ERROR(ApplyOverride(root, o));
    from_set.insert(o.substr(0, o.find('=')));
  }
  auto named = [&from_set](const std::string& name) {
    return from_set.count(name) ? "--set " + name : name;
  };

  std::map<std::string, std::map<std::string, const KeySpec*>> known;
  for (auto& s : Table()) known[s.doc.section][s.doc.key] = &s;

  JobConfig cfg;
  cfg.data.packing = DataPacking::kAuto;  // resolved below, once data.format is known
  for (auto& [sec_name, sec_node] : root) {
    std::string sec(sec_name.str());
    auto it = known.find(sec);
    if (it == known.end()) {
      const bool set = std::any_of(from_set.begin(), from_set.end(), [&sec](const std::string& k) {
        return k.rfind(sec + ".", 0) == 0;
      });
      std::vector<std::string> sections;
      for (const auto& [name, keys] : known) sections.push_back(name);
      const std::string close = ClosestMatch(sec, sections);
      return Status::InvalidArgument(
          (set ? "--set " : "") + sec + ": unknown section" +
          (close.empty() ? "" : "; did you mean [" + close + "]?") +
          " (known: job, model, data, train, optimizer, lora, schedule, checkpoint, "
          "metrics)");
    }
    const toml::table* tbl = sec_node.as_table();
    if (!tbl) return Status::InvalidArgument(sec + ": must be a [" + sec + "] table");
    for (auto& [key_name, node] : *tbl) {
      std::string key(key_name.str());
      auto kit = it->second.find(key);
      if (kit == it->second.end())
        return Status::InvalidArgument(named(sec + "." + key) + ": unknown key" +
                                       Suggestion(Table(), sec, key) +
                                       " (every key: configs/README.md, rp-launch --print-keys)");
      RP_RETURN_IF_ERROR(kit->second->set(node, cfg, named(sec + "." + key)));
    }
  }
  // Keys that say the same thing two ways: the job gives one of them.
  auto given = [&root](const char* section, const char* key) {
    const toml::table* t = root[section].as_table();
    return t != nullptr && t->contains(key);
  };
  if (cfg.train.epochs > 0 && given("train", "steps"))
    return Status::InvalidArgument(
        "train.epochs and train.steps: both given; give one (epochs derives the "
        "steps from the data's windows)");
  if (cfg.train.epochs > 0 && cfg.data.format == DataFormat::kRandom)
    return Status::InvalidArgument(
        "train.epochs: data.format = \"random\" is an endless synthetic stream "
        "without epochs; give train.steps");
  if (cfg.optimizer.warmup_ratio > 0 && given("optimizer", "warmup_steps"))
    return Status::InvalidArgument(
        "optimizer.warmup_ratio and optimizer.warmup_steps: both given; give one");
  // With epochs the steps, and so a warmup ratio's steps, are known once the data is read
  // (ResolveTrainingLength).
  if (cfg.train.epochs == 0) ResolveWarmup(&cfg);
  cfg.data.path = Join(base_dir, cfg.data.path);
  if (cfg.job.output_dir.empty())
    return Status::InvalidArgument(
        "job.output_dir: empty; name the directory the run's outputs go to");
  cfg.job.output_dir = Join(base_dir, cfg.job.output_dir);
  cfg.lora.init_from = Join(base_dir, cfg.lora.init_from);
  cfg.data.eval_path = Join(base_dir, cfg.data.eval_path);
  if (cfg.data.packing == DataPacking::kAuto)
    cfg.data.packing =
        cfg.data.format == DataFormat::kJsonl ||
                (cfg.data.format == DataFormat::kTokens && TokenFileHasDocuments(cfg.data.path))
            ? DataPacking::kDocuments
            : DataPacking::kStream;
  if (!cfg.model.path.empty()) {
    // The checkpoint's config.json decides the architecture; every process reads the same file.
    RP_ASSIGN_OR_RETURN(cfg.model.path, ResolveModelPath(cfg.model.path, base_dir));
    JobConfig as_given = cfg;
    RP_RETURN_IF_ERROR(ApplyHfConfig(cfg.model.path, &cfg.model));
    RP_RETURN_IF_ERROR(CheckModelKeysAgree(as_given, cfg, given, named));
    if (cfg.checkpoint.export_dtype == ExportDtype::kAuto) {
      // The export is served as the base was: in the dtype its config.json names.
      const std::string base = HfBaseDtype(cfg.model.path);
      if (base.empty() || base == "float32") cfg.checkpoint.export_dtype = ExportDtype::kFloat32;
      else if (base == "bfloat16") cfg.checkpoint.export_dtype = ExportDtype::kBfloat16;
      else if (base == "float16") cfg.checkpoint.export_dtype = ExportDtype::kFloat16;
      else
        return Status::InvalidArgument(
            "checkpoint.export_dtype: \"auto\" takes the base's dtype, and " + cfg.model.path +
            "/config.json names \"" + base + "\"; set \"float32\", \"bfloat16\" or \"float16\"");
    }
  } else {
    // A model from job keys is written out as the family its q/k norm and experts name.
    cfg.model.model_type = cfg.model.moe.num_experts > 0 ? "qwen3_moe"
                           : cfg.model.qk_norm           ? "qwen3"
                                                         : "llama";
  }
  if (cfg.checkpoint.export_dtype == ExportDtype::kAuto)
    cfg.checkpoint.export_dtype = ExportDtype::kFloat32;
  // A device memory limit is a smaller card: the planner plans for it, decided here once. The
  // allocator refuses past the limit itself, so the plan keeps a share of it for what the
  // planner's estimate leaves out (the allocator's fragmentation, short-lived temporaries).
  // Without a limit or a budget, CUDA workers plan for the card itself the same way; a budget
  // the user gave is kept.
  constexpr double kPlannedShareOfCard = 0.85;
  const auto planned_gb = [&](double gib) {
    return kPlannedShareOfCard * gib * 1073741824.0 / 1e9;
  };
  if (cfg.job.device_memory_limit_gib > 0) {
    const double limit_gb = planned_gb(cfg.job.device_memory_limit_gib);
    if (!(cfg.schedule.gpu_memory_gb > 0) || cfg.schedule.gpu_memory_gb > limit_gb)
      cfg.schedule.gpu_memory_gb = limit_gb;
  } else if (host.gpu_memory_gib > 0 && cfg.job.device != DeviceKind::kCpu) {
    // A budget above the card's whole memory plans what cannot run: the workers would fail out
    // of memory one replacement after another. Said here, before anything starts.
    const double card_gb = host.gpu_memory_gib * 1073741824.0 / 1e9;
    if (cfg.schedule.gpu_memory_gb > card_gb) {
      char msg[320];
      std::snprintf(
          msg, sizeof msg,
          "schedule.gpu_memory_gb = %g is more than this host's smallest visible GPU holds "
          "(%.1f GB, %.1f GiB); remove it (or --set schedule.gpu_memory_gb=0) to plan for 85%% "
          "of the card (%.1f GB), or set it lower",
          cfg.schedule.gpu_memory_gb, card_gb, host.gpu_memory_gib,
          planned_gb(host.gpu_memory_gib));
      return Status::InvalidArgument(msg);
    }
    if (!(cfg.schedule.gpu_memory_gb > 0))
      cfg.schedule.gpu_memory_gb = planned_gb(host.gpu_memory_gib);
  }
  RP_RETURN_IF_ERROR(ReadBenchKnobs(&cfg.bench));
  return cfg;
}

StatusOr<JobConfig> ParseJobConfig(const std::string& toml_text, const std::string& base_dir,
                                   const std::vector<std::string>& overrides,
                                   const HostFacts& host) {
  // Passed on as they are: the parse's refusals already name where they arose.
  StatusOr<JobConfig> parsed =
      ParseJobConfigBeforeCrossChecks(toml_text, base_dir, overrides, host);
  if (!parsed.ok()) return parsed.status();
  JobConfig cfg = std::move(parsed).value();
  RP_RETURN_IF_ERROR(CrossValidate(cfg));
  if (MergeCalls(cfg)) {
    if (cfg.train.microbatches * cfg.train.accum_calls > 4096)
      return Status::InvalidArgument(
          "RP_MERGE_CALLS: train.accum_calls x train.microbatches = " +
          std::to_string(cfg.train.microbatches * cfg.train.accum_calls) +
          " microbatches in one round, above train.microbatches' limit of 4096 "
          "(RP_MERGE_CALLS=never keeps the calls)");
  }
  return cfg;
}

StatusOr<JobConfig> LoadJobConfig(const std::string& path,
                                  const std::vector<std::string>& overrides,
                                  const HostFacts& host) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    return Status::InvalidArgument("job file: no such file: " + path);
  std::ifstream in(path);
  if (!in) return Status::InvalidArgument("job file: cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  fs::path abs = fs::absolute(path, ec).lexically_normal();
  auto cfg = ParseJobConfig(ss.str(), abs.parent_path().string(), overrides, host);
  if (!cfg.ok()) {
    const std::string& message = cfg.status().message();
    // A --set value is not the file's fault.
    if (message.rfind("--set ", 0) == 0) return Status::InvalidArgument(message);
    return Status::InvalidArgument(path + ": " + message);
  }
  cfg->source_path = abs.string();
  return cfg;
}

Status CheckNodes(const JobConfig& c) {
  const int64_t n = c.nodes.count;
  if (n < 1 || c.nodes.rank < 0 || c.nodes.rank >= n)
    return Status::InvalidArgument("nodes: rank " + std::to_string(c.nodes.rank) + " of " +
                                   std::to_string(n) + " nodes is not a node of the run");
  if (n == 1) return Status::Ok();
  const RoundShape g = GlobalRound(c);
  if (g.microbatches % n != 0)
    return Status::InvalidArgument(
        "train.microbatches: a step's " + std::to_string(g.microbatches) +
        " microbatches per round" +
        (g.merged_calls > 1 ? " (train.accum_calls x train.microbatches, the calls run merged)"
                            : std::string()) +
        " do not split evenly over " + std::to_string(n) +
        " nodes; make it a multiple of the node count");
  const ExecutionPlan x = ResolveExecution(c);
  if (x.speculative_update)
    return Status::InvalidArgument(
        "optimizer.speculative_update: not supported with several nodes; leave it "
        "false");
  if (x.device_update_blocks > 0)
    return Status::InvalidArgument(
        "optimizer.device_update_blocks: not supported with several nodes; leave it 0");
  if (x.gradients_wait_in_workers)
    return Status::InvalidArgument(
        "optimizer.gradients_wait_in: \"workers\" with several nodes is not "
        "supported (each node's norm would need the summed gradients first); use "
        "\"host\"");
  if (x.sharded_state && c.checkpoint.export_every > 0)
    return Status::InvalidArgument(
        "checkpoint.export_every: with optimizer.state = \"sharded\" no node holds "
        "every weight while training goes on; export at the end only (0)");
  if (x.sharded_state && c.train.dtype != TrainDtype::kFp32 && !x.workers_fetch_masters)
    return Status::InvalidArgument(
        "optimizer.state: \"sharded\" with train.dtype = \"" +
        std::string(EnumName(c.train.dtype)) + "\" and schedule.weights_source = \"" +
        std::string(EnumName(c.schedule.weights_source.Read(ModeKeyGrant::Access()))) + "\" in " +
        std::string(EnumName(c.optimizer.mode.Read(ModeKeyGrant::Access()))) +
        " mode: the export at the end reads the gathered weights, which hold the fp32 "
        "masters only where workers fetch them (exact mode, weights_source \"auto\") or "
        "in fp32; use \"replicated\"");
  return Status::Ok();
}

bool MergeCalls(const JobConfig& c) {
  if (c.train.accum_calls < 2 || c.bench.merge_calls == Tristate::kNever) return false;
  return c.bench.merge_calls == Tristate::kAlways ||
         (c.optimizer.mode.Read(ModeKeyGrant::Access()) == OptimizerMode::kExact &&
          c.train.accum_calls == 2);
}

}  // namespace rp::core
