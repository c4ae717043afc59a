// SPDX-License-Identifier: Apache-2.0
// JobConfig: the TOML job file, validated.
//
// Contract:
//  * LoadJobConfig() parses a job file, applies `--set section.key=value` overrides, and
//    validates everything before any process or shared-memory segment exists. Any problem is an
//    InvalidArgument Status whose message starts with the key ("train.steps: must be >= 1, got 0").
//  * Unknown sections and keys are errors (a typo must never be silently ignored).
//  * Every key is declared once in the table in job_config.cc; `configs/README.md` documents the
//    same table and a unit test keeps the two in sync.
//  * Relative paths (data.path, job.output_dir) resolve against the job file's directory.
//  * The struct is a plain value: copy it freely; no thread-safety concerns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/test_hooks.h"

namespace rp::core {

// The passkey that reads a mode key (ModeKey): only ModeKeyGrant (config/mode_key_access.h)
// makes one, and only the job file's reader and writers, its checks, ResolveExecution
// (config/execution_plan.h) and the files that record a key's spelling include that header
// (Tools.ModeKeysAreReadInTheResolutionOnly checks the list).
class ModeKeyAccess {
  ModeKeyAccess() = default;
  friend struct ModeKeyGrant;
};

// A key that decides how a run executes (its optimizer mode, where activations and the state
// live, where weights are fetched from, how the plan is found): anyone may set it, as a job file
// or a test does, but reading it takes a ModeKeyAccess. Everything else asks the ExecutionPlan
// that ResolveExecution derives from these keys once, so no component re-derives a decision.
template <typename T>
class ModeKey {
 public:
  constexpr ModeKey(T value = T{}) : value_(value) {}  // NOLINT: set like the plain value it is
  T Read(const ModeKeyAccess&) const { return value_; }
  T& Field(const ModeKeyAccess&) { return value_; }

 private:
  T value_;
};

// Every mode a job file names, as a type: the strings exist only in the key table
// (job_config.cc), which maps them once; EnumName() gives them back for logs and output files.
enum class DeviceKind : uint8_t { kAuto, kCpu, kCuda };                // job.device
enum class DataFormat : uint8_t { kBytes, kTokens, kJsonl, kRandom };  // data.format
// data.packing: kAuto is resolved when the job is parsed (documents for jsonl, stream otherwise).
enum class DataPacking : uint8_t { kAuto, kStream, kDocuments, kPad };
enum class LongRecords : uint8_t { kSplit, kTruncate, kDrop };    // data.long_records
enum class TrainDtype : uint8_t { kFp32, kBf16, kFp16, kFp8 };    // train.dtype
enum class OptimizerName : uint8_t { kAdamW, kSgd };              // optimizer.name
enum class OptimizerMode : uint8_t { kExact, kStale1 };           // optimizer.mode
enum class OptimizerState : uint8_t { kReplicated, kSharded };    // optimizer.state
enum class LrSchedule : uint8_t { kCosine, kLinear, kConstant };  // optimizer.lr_schedule
enum class ExportDtype : uint8_t {
  kAuto,
  kFloat32,
  kBfloat16,
  kFloat16
};                                                              // checkpoint.export_dtype
enum class GradientsWait : uint8_t { kHost, kWorkers };         // optimizer.gradients_wait_in
enum class Activations : uint8_t { kHost, kWorker, kCudaIpc };  // schedule.activations
enum class WeightsSource : uint8_t { kAuto, kComputeCopy };     // schedule.weights_source
enum class EmbeddingLookup : uint8_t { kAuto, kCopy };          // schedule.embedding_lookup
enum class Partition : uint8_t { kEqual, kAuto };               // schedule.partition
// Bench and test switches (BenchKnobs below), not job keys.
enum class Tristate : uint8_t { kAuto, kAlways, kNever };

const char* EnumName(DeviceKind v);
const char* EnumName(DataFormat v);
const char* EnumName(DataPacking v);
const char* EnumName(LongRecords v);
const char* EnumName(TrainDtype v);
const char* EnumName(OptimizerName v);
const char* EnumName(OptimizerMode v);
const char* EnumName(OptimizerState v);
const char* EnumName(LrSchedule v);
const char* EnumName(ExportDtype v);
const char* EnumName(GradientsWait v);
const char* EnumName(Activations v);
const char* EnumName(WeightsSource v);
const char* EnumName(EmbeddingLookup v);
const char* EnumName(Partition v);
const char* EnumName(Tristate v);

// Rotary position embedding of the query and key heads. Every variant only changes the
// per-frequency rates and one factor on cos/sin (config/rope.h computes both), so one table builder
// serves the CPU composite, the fused CUDA kernels and rp-train-ref alike.
struct RopeConfig {
  enum class Type : uint8_t { kDefault, kLinear, kLlama3, kYarn };
  Type type = Type::kDefault;
  double theta = 10000.0;
  double factor = 1.0;                       // linear, llama3, yarn
  double low_freq_factor = 1.0;              // llama3
  double high_freq_factor = 4.0;             // llama3
  int64_t original_max_position = 0;         // llama3, yarn: the pretraining context
  double attention_factor = 1.0;             // yarn: cos and sin are multiplied by it (resolved)
  double beta_fast = 32.0, beta_slow = 1.0;  // yarn: the ramp's rotation bounds
  bool truncate = true;                      // yarn: round the ramp's bounds to whole dimensions
};
const char* RopeTypeName(RopeConfig::Type t);

// Mixture-of-experts blocks (Qwen3-MoE, from config.json only): a sparse block's MLP is a router
// (softmax over the experts, the top experts_per_token kept, renormalized when norm_topk_prob)
// and num_experts SwiGLU experts of expert_intermediate_size; the other blocks keep the dense MLP
// of intermediate_size. No experts: every block is dense.
struct MoeConfig {
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;         // num_experts_per_tok
  int64_t expert_intermediate_size = 0;  // moe_intermediate_size
  bool norm_topk_prob = false;
  int64_t sparse_step = 1;            // decoder_sparse_step
  std::vector<int64_t> dense_layers;  // mlp_only_layers (0-based decoder indices)
  // The routers' load-balancing loss in the objective: router_aux_loss_coef when
  // output_router_logits is true (transformers adds it exactly then), else 0. Each microbatch's
  // loss is transformers' for one forward over it; a step adds their mean (RouterAuxWeight).
  double aux_loss_weight = 0.0;
};

struct ModelConfig {
  std::string path;  // Hugging Face model directory; its config.json sets the architecture keys
  // The transformers model_type the weights follow: "llama", "qwen2", "qwen3" or "mistral".
  // Decided once (config.json, or from qk_norm for a job without model.path) and used by the
  // export; the math itself reads the flags below, never this name.
  std::string model_type;
  int64_t vocab_size = 256;
  int64_t hidden_size = 128;
  int64_t intermediate_size = 384;
  int64_t num_layers = 4;  // decoder blocks
  int64_t num_heads = 4;
  int64_t num_kv_heads = 2;  // grouped-query attention when < num_heads
  int64_t head_dim = 32;
  RopeConfig rope;  // model.rope_theta is rope.theta; config.json sets all of it
  double rms_norm_eps = 1e-6;
  bool qk_norm = true;    // Qwen3's per-head RMSNorm on q and k
  bool qkv_bias = false;  // biases on q/k/v_proj (Qwen2; Llama's attention_bias)
  bool o_bias = false;    // bias on o_proj (Llama's attention_bias)
  bool mlp_bias = false;  // biases on gate/up/down_proj (Llama's mlp_bias)
  bool tie_embeddings = true;
  // Attention window in tokens (0: none). Sequences no longer than it see plain causal
  // attention, so a job whose data.seq_len fits is exact; a longer one is refused.
  int64_t sliding_window = 0;
  int64_t max_position_embeddings = 32768;  // written back on export; YaRN's default factor
  double init_std = 0.02;
  MoeConfig moe;
};

// Whether decoder block `block` (0-based, as transformers counts layers) has the experts:
// transformers' rule, not in mlp_only_layers and (block + 1) a multiple of decoder_sparse_step.
bool SparseBlock(const ModelConfig& m, int64_t block);
// The sparse blocks before `block` (its index among them when it is sparse), and their count.
int64_t SparseBlocksBefore(const ModelConfig& m, int64_t block);
inline int64_t SparseBlocks(const ModelConfig& m) { return SparseBlocksBefore(m, m.num_layers); }

struct DataConfig {
  DataFormat format = DataFormat::kBytes;  // bytes: UTF-8 file as byte tokens; random: synthetic
  std::string path;                        // resolved to an absolute path
  int64_t seq_len = 64;
  bool shuffle = true;
  std::string eval_path;       // held-out corpus in data.format; "" = none
  double eval_fraction = 0.0;  // or: the last fraction of data.path's windows, never trained on
  // How records share a window (io/data.h): "stream" cuts the concatenated records into windows
  // and attends across them; "documents" packs whole records, each attending only to itself with
  // RoPE positions restarting at its first token; "pad" puts one record in each window.
  // A parsed job never holds kAuto (ParseJobConfig resolves it); a JobConfig built in code
  // starts with stream.
  DataPacking packing = DataPacking::kStream;
  LongRecords long_records =
      LongRecords::kSplit;  // records longer than seq_len ("documents", "pad")
};

// fp16's dynamic loss scaling (torch.amp.GradScaler's rule): each step's loss is multiplied by
// the current scale before the backward, the gradients divided by it before clipping and the
// update. A step whose gradients are not all finite is skipped (no update, no moment decay, the
// AdamW step count not advanced) and the scale multiplied by backoff_factor; after growth_interval
// finite steps in a row it is multiplied by growth_factor. Only train.dtype = "fp16" scales.
struct LossScaling {
  double init = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

inline constexpr int64_t kMlpTileAuto = -1;  // train.mlp_tile_tokens chosen by the planner
// schedule.keep_attention: as many blocks as fit (core::ResolveKeptAttention).
inline constexpr int64_t kKeepAttentionAuto = -1;
inline constexpr int64_t kKeptBlocksAuto =
    -1;  // schedule.kept_blocks: as many as fit (core::ResolveKeptBlocks)

struct TrainConfig {
  int64_t steps = 20;  // resolved from epochs when epochs > 0 (core::ResolveTrainingLength)
  double epochs = 0;   // passes over data.path's windows; 0 = train.steps decides
  int64_t seed = 1234;
  int64_t microbatches = 3;     // M per accumulation call, as the job file says
  int64_t accum_calls = 2;      // K calls per optimizer step, as the job file says (Round below)
  int64_t microbatch_size = 2;  // sequences per microbatch
  TrainDtype dtype = TrainDtype::kFp32;  // compute dtype; masters are fp32
  LossScaling loss_scaling;              // fp16 only
  double grad_clip = 1.0;                // global L2 norm; 0 disables
  int64_t loss_chunk_tokens = 4096;      // head + loss computed this many tokens at a time
  // Dense MLPs computed (and recomputed) this many tokens at a time; 0 = all; kMlpTileAuto = the
  // planner chooses (core::ResolveMlpTile, before anything else reads it).
  int64_t mlp_tile_tokens = 0;
  bool layer_recompute =
      false;  // backward stages rebuild one layer's graph at a time (long sequences)
  int64_t stop_after =
      0;  // stop (with a checkpoint) once this many steps are done; 0 = train.steps
  int64_t eval_every = 0;  // eval loss after every this many steps and after the last; 0 = never
  int64_t eval_microbatches =
      4;  // the eval set: this many microbatches of microbatch_size sequences
};

// optimizer.update_passes = 0: the planner chooses (core::ResolveUpdatePasses).
inline constexpr int64_t kUpdatePassesAuto = 0;

struct OptimizerConfig {
  OptimizerName name = OptimizerName::kAdamW;
  ModeKey<OptimizerMode> mode = OptimizerMode::kExact;
  ModeKey<OptimizerState> state = OptimizerState::kReplicated;  // several nodes only
  ModeKey<GradientsWait> gradients_wait_in = GradientsWait::kHost;
  double lr = 3e-3;
  double min_lr = 3e-4;
  LrSchedule lr_schedule =
      LrSchedule::kCosine;   // after warmup, toward min_lr (config/lr_schedule.h)
  int64_t warmup_steps = 2;  // resolved from warmup_ratio when it is > 0
  double warmup_ratio = 0;   // warmup as a share of train.steps; 0 = warmup_steps decides
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double momentum = 0.9;       // SGD only
  int64_t grad_buffer_mb = 0;  // gradient arena in MiB; 0 = auto (shm/layout.h)
  ModeKey<bool> speculative_update = false;
  ModeKey<int64_t> device_update_blocks = 0;
  // kUpdatePassesAuto, 1 or 2 (core::ResolveUpdatePasses chooses for auto)
  ModeKey<int64_t> update_passes = kUpdatePassesAuto;
};

// LoRA (low-rank adapters, PEFT's conventions): every targeted projection W of every block gets
// trainable A [rank, in] and B [out, rank]; the layer computes x W^T + scale * drop(x) A^T B^T
// with scale = alpha / rank. Everything else is frozen (kept only as the compute copy).
struct LoraConfig {
  int64_t rank = 0;  // 0: full fine-tuning
  double alpha = 8.0;
  double dropout = 0.0;  // on the adapter's input, as PEFT's lora_dropout
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};
  // Whole tensors that get adapters, as PEFT's target_parameters names them: a mixture-of-experts
  // model's fused expert tensors (LoraTargetableParameters), one adapter over every expert.
  std::vector<std::string> target_parameters;
  std::string init_from;  // PEFT adapter directory to start from; "" = A random, B zero
  std::string export_dir = "adapter";  // PEFT directory written after the last step (in output_dir)

  bool enabled() const { return rank > 0; }
  double scale() const { return alpha / static_cast<double>(rank); }
};

// The projections LoRA can target, in the order a block applies them.
const std::vector<std::string>& LoraTargetableModules();

// The tensors lora.target_parameters can name, in the order transformers registers them
// (Qwen3-MoE's expert tensors; PEFT nests one wrapper per tensor in that order, so the order
// decides the adapters' names, see core::BuildModelSpec).
const std::vector<std::string>& LoraTargetableParameters();
// The tensor of LoraTargetableParameters() that `name` names as PEFT matches target_parameters:
// the whole name, or a suffix of it that starts after a dot ("gate_up_proj",
// "experts.gate_up_proj"); "" when it names none.
std::string CanonicalLoraParameter(const std::string& name);

struct ScheduleConfig {
  int64_t forward_stages = 2;   // equal split of the forward layers when forward_cuts is empty
  int64_t backward_stages = 2;  // equal split of the non-tail backward layers
  int64_t tail_blocks = 0;      // decoder blocks fused into the tail with norm + head + loss
  int64_t kept_blocks = 0;      // blocks before the tail whose forward graphs wait on the device;
                                // kKeptBlocksAuto = as many as fit gpu_memory_gb
  // The recomputed blocks (those just below the kept blocks or the tail) whose attention output
  // and log-sum-exp wait on the device from their forward to their backward stage, whose
  // recompute then runs no attention forward (model/recorded_attention.h); kKeepAttentionAuto =
  // as many as fit gpu_memory_gb
  int64_t keep_attention = 0;
  // LoRA: each worker keeps the whole frozen base on its device (ExecutionPlan)
  ModeKey<bool> frozen_on_device = false;
  // host: shared-memory slots; worker: the one worker's memory; cuda_ipc: each producing
  // worker's pool, mapped by its consumers (ExecutionPlan::ActivationsInPools)
  ModeKey<Activations> activations = Activations::kHost;
  ModeKey<WeightsSource> weights_source = WeightsSource::kAuto;
  ModeKey<EmbeddingLookup> embedding_lookup = EmbeddingLookup::kAuto;
  std::vector<int64_t> forward_cuts;   // explicit stage start layers (layer 0 = embedding)
  std::vector<int64_t> backward_cuts;  // explicit stage start layers of the backward stages
  // equal: stage counts or explicit cuts; auto: the planner chooses
  ModeKey<Partition> partition = Partition::kEqual;
  double gpu_memory_gb = 0.0;   // per-worker memory limit for "auto"; 0 = unlimited
  double host_memory_gb = 0.0;  // shared memory an "auto" plan may take; 0 = not planned for
  std::string profile;          // measured profile for "auto" (planning/profile.h); "" = cost model
  int64_t profile_steps = 2;    // steps timed per layer after a warm-up step; 0 = none
  double replan_gain = 0.05;    // predicted speed-up that justifies restarting on a new plan
  double drift = 0.2;           // measured/predicted step mismatch that triggers re-profiling
  double node_link_gb_s = 10.0;  // several nodes: the planner's bandwidth between nodes
};

struct CheckpointConfig {
  int64_t every = 0;  // steps between checkpoints; 0 = none (but see train.stop_after)
  std::string dir = "checkpoints";
  int64_t keep = 2;         // newest checkpoints kept
  double memory_gb = -1.0;  // host memory for the background copy; < 0 = from MemAvailable
  std::string export_hf;    // HF directory written after the last step (relative to output_dir)
  int64_t export_shard_mb = 5000;  // export_hf shards above this size; 0 = one file
  // The export's tensors; a parsed job holds kAuto resolved (the base's dtype, else float32).
  ExportDtype export_dtype = ExportDtype::kAuto;
  int64_t export_every = 0;  // also export after every this many steps, beside the final one
};

struct MetricsConfig {
  bool trace = true;        // write trace.json
  bool tensorboard = true;  // write TensorBoard event files under OUTPUT/tb (io/tensorboard.h)
};

// Switches for A/B benchmarks and tests, not job keys: each picks between implementations that
// give the same results (bit for bit, or the same math summed in another order), so a user never
// needs them. Read from the environment (RP_<NAME>, e.g. RP_MERGE_CALLS=never) by ParseJobConfig;
// rp-launch's children inherit it, so every process of a run reads the same values.
struct BenchKnobs {
  bool interleave_calls = true;                    // RP_INTERLEAVE_CALLS=0|1: core::StepJobOrder
  Tristate merge_calls = Tristate::kAuto;          // RP_MERGE_CALLS=auto|always|never: MergeCalls
  Tristate layer_major_forward = Tristate::kAuto;  // RP_LAYER_MAJOR_FORWARD: worker::Executor
  bool fused_kernels = true;  // RP_FUSED_KERNELS=0|1: GPU workers use the project's kernels
  bool fused_norms = true;    // RP_FUSED_NORMS=0|1: ... including its RMSNorm (+ add) kernel
  bool grouped_experts =
      true;  // RP_GROUPED_EXPERTS=0|1: model::Transformer::Experts' grouped GEMMs
  int64_t optimizer_threads = 0;  // RP_OPTIMIZER_THREADS: pool size; 0 = every usable core
  int64_t optimizer_rest_threads =
      0;  // RP_OPTIMIZER_REST_THREADS: exact mode's second passes; 0 = a quarter
};

struct JobOptions {
  std::string name = "job";
  std::string output_dir = "output";
  DeviceKind device = DeviceKind::kAuto;
  int64_t max_worker_restarts = 3;  // replacements the launcher starts for dead workers
  double worker_timeout_s = 60.0;   // a worker silent this long is declared hung; 0 = never
  double stopped_timeout_s =
      600.0;  // a stopped (SIGSTOP, debugger) process is waited for this long
  double device_memory_limit_gib = 0.0;  // each CUDA worker's allocator cap; 0 = the whole device
  double node_timeout_s = 60.0;          // several nodes: a node silent this long stops the others
};

// Data-parallel nodes (rp-launch --nnodes, or torchrun's or Slurm's environment): one rp-launch
// per host, each with its own coordinator, workers and shared memory; a step's microbatches are
// split between them and the gradients summed across them before the update. Resolved by
// rp-launch (launcher/node_world.h), never read from the job file.
struct NodesConfig {
  int64_t count = 1;
  int64_t rank = 0;
  std::string store_host;  // the rendezvous store, hosted by node 0's rp-launch
  int64_t store_port = 0;
};

struct JobConfig {
  JobOptions job;
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  OptimizerConfig optimizer;
  LoraConfig lora;
  ScheduleConfig schedule;
  CheckpointConfig checkpoint;
  MetricsConfig metrics;
  BenchKnobs bench;
  NodesConfig nodes;

  std::string source_path;  // the job file, absolute

  // Derived: layers in the pipeline = embedding + blocks + head.
  int64_t TotalLayers() const { return model.num_layers + 2; }
  int64_t TokensPerMicrobatch() const { return train.microbatch_size * data.seq_len; }
};

// What the launching host offers a job that leaves it to the host: the memory of its smallest
// visible GPU in GiB (0 = none or unknown). CUDA workers with neither schedule.gpu_memory_gb nor
// job.device_memory_limit_gib plan for 85% of it, as for a memory limit, so a plan never
// outgrows the card unnoticed.
struct HostFacts {
  double gpu_memory_gib = 0.0;
};

// Parses `path`, applies overrides ("section.key=value"; the value is TOML, or a bare string),
// validates. The returned message names the key and the problem.
StatusOr<JobConfig> LoadJobConfig(const std::string& path,
                                  const std::vector<std::string>& overrides,
                                  const HostFacts& host = {});
// optimizer.warmup_ratio > 0: warmup_steps = ceil(ratio x train.steps). LoadJobConfig does it when
// train.steps is given; with train.epochs, core::ResolveTrainingLength (io/data.h) once the steps
// are known.
void ResolveWarmup(JobConfig* c);
// Whether the sidecar of the token file `path` (<path>.json) names a document index (io/data.h):
// such a file is records, packed as "documents" by default. False when there is no readable
// sidecar (the dataset then says what is wrong).
bool TokenFileHasDocuments(const std::string& path);
// Same from TOML text (tests); `base_dir` resolves relative paths.
StatusOr<JobConfig> ParseJobConfig(const std::string& toml_text, const std::string& base_dir,
                                   const std::vector<std::string>& overrides,
                                   const HostFacts& host = {});

// One documented key: the table that drives parsing, validation and configs/README.md.
struct KeyDoc {
  std::string section;
  std::string key;
  std::string type;  // "int" | "float" | "bool" | "string" | "int array" | "enum"
  std::string default_value;
  std::string meaning;
};
std::vector<KeyDoc> DocumentedKeys();

// `config` as a job file: every key of the table, defaults included, with its value in `config`,
// under the job keys' names, so that loading the text gives `config` back. Keys that another key
// decides are left out, as a job file must: the architecture keys when model.path is set (its
// config.json decides them), a dense model's expert keys, train.steps when train.epochs does,
// optimizer.warmup_steps when optimizer.warmup_ratio does. Every run keeps this as
// OUTPUT/job.toml (rp-launch --resume RUN_DIR reads it); --dry-run prints it.
std::string JobToml(const JobConfig& config);

// The values of the keys that decide a run's trajectory, as "section.key" -> the value as a job
// file spells it: the model, data, training, optimizer and adapter keys, less the run's length
// (train.steps, train.epochs, train.stop_after), its evaluation cadence, file locations, the
// keys that change only speed and where the optimizer state lives. data.path is recorded by file
// name and size (a run and its data may move). Every training checkpoint records them; --resume
// refuses another run's checkpoint by comparing them.
using RunRecord = std::map<std::string, std::string>;
RunRecord RunDefiningValues(const JobConfig& config);
// One line per key whose value differs, or that only one side records:
// "optimizer.lr 0.0001 there, 0.0003 here" (there: the checkpoint's run; here: the job's).
std::vector<std::string> RunDifferences(const RunRecord& checkpoint, const RunRecord& job);

// Checks `value` against the range of the numeric job key model.<key>, with that key's message
// under `name` ("<dir>/config.json: num_hidden_layers: must be in [1, 4096], got 100000"): values
// from a checkpoint's config.json get the job keys' validation.
Status CheckModelValue(const std::string& key, double value, const std::string& name);

// Bytes of one element of train.dtype: what compute copies, frozen weights and activations take.
inline int ComputeElemBytes(const JobConfig& c) {
  return c.train.dtype == TrainDtype::kFp32 ? 4 : 2;
}
// Whether CUDA workers run the project's fused kernels: bench.fused_kernels, and a dtype they take
// (fp32, bf16, fp8; fp16 runs LibTorch's own operators).
inline bool FusedKernelsApply(const JobConfig& c) {
  return c.bench.fused_kernels && c.train.dtype != TrainDtype::kFp16;
}
// train.dtype = "fp8": weights, activations and gradients are bf16 as with "bf16", and the
// blocks' projections multiply in e4m3 (model/fp8.h): the forward product and the input gradient
// from row-scaled e4m3 operands, the weight gradient in bf16 with fp32 sums. The head, the router,
// experts, attention and LoRA adapters stay bf16. CUDA workers only (validated).
inline bool Fp8Matmuls(const JobConfig& c) { return c.train.dtype == TrainDtype::kFp8; }
// Whether each step's loss is scaled (LossScaling).
inline bool ScalesLoss(const JobConfig& c) { return c.train.dtype == TrainDtype::kFp16; }

// The elements [begin, end) of a parameter of `numel` elements that node `rank` of `nodes` owns
// under sharded state: consecutive shares of ceil(numel / nodes) elements rounded up to 16 (64
// bytes of fp32), the last ones shorter or empty. A pure function: every node, and a resume on
// another node count, derives every node's share from it.
struct ElemRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
inline ElemRange ShardOf(int64_t numel, int64_t nodes, int64_t rank) {
  if (nodes <= 1) return {0, numel};
  const int64_t share = ((numel + nodes - 1) / nodes + 15) / 16 * 16;
  const int64_t begin = std::min(numel, share * rank);
  return {begin, std::min(numel, begin + share)};
}

// RP_MERGE_CALLS (BenchKnobs) resolved on the job file's values: whether the K accumulation calls
// of a step run as one round of K x M microbatches. The math is the same (the step's loss scale is
// one over the step's targets either way, the data index of microbatch m of call c is c x M + m in
// both, and gradients are summed over every microbatch in fp32; only the order of that sum
// differs), but each stage's weights are fetched once per step instead of K times, and each
// stage's gradients are committed once instead of K times (no accumulating commit reading the
// previous call's sums back). "auto" merges in exact mode with two calls: there one round of 2M
// microbatches needs exactly the activation slots that two calls in flight need (exact mode
// with one call has one slot parity), so merging costs no memory. More calls, or stale1 (two
// parities either way), would need K/2 times the activation memory: "always" accepts that.
// Round() below applies it, so
// every process, the layout and the planner see the merged round.
bool MergeCalls(const JobConfig& c);

// How a step runs, against how the job file states it (train.accum_calls calls of
// train.microbatches, which keep the user's values): `calls` rounds of `microbatches`
// microbatches each; with MergeCalls one round of K x M, `merged_calls` = K job-file calls in it
// (else 1). Everything that runs, lays out or plans a step reads this; microbatch m of round r
// is job-file call (r x merged_calls + m / M), microbatch m % M, and the data index and dropout
// key of the two are the same.
struct RoundShape {
  int64_t calls = 1;
  int64_t microbatches = 1;
  int64_t merged_calls = 1;
};
// With several nodes (NodesConfig) Round() is this node's share: each round's microbatches are
// split evenly, node r taking the r-th contiguous block (CheckNodes refuses an uneven split), and
// GlobalRound() is the whole step's. Data indices and dropout keys come from StepMicrobatch(), so
// a step draws the same sequences whatever the node count.
inline RoundShape GlobalRound(const JobConfig& c) {
  if (MergeCalls(c)) return {1, c.train.accum_calls * c.train.microbatches, c.train.accum_calls};
  return {c.train.accum_calls, c.train.microbatches, 1};
}
inline RoundShape Round(const JobConfig& c) {
  RoundShape r = GlobalRound(c);
  r.microbatches /= std::max<int64_t>(1, c.nodes.count);
  return r;
}
// Sequences (windows of data.seq_len) one optimizer step reads over every node.
inline int64_t SequencesPerStep(const JobConfig& c) {
  return c.train.accum_calls * c.train.microbatches * c.train.microbatch_size;
}
// The index within its step of this node's microbatch `mb` of round `call`: the key of its data
// and its dropout masks, the same for every node count.
inline int64_t StepMicrobatch(const JobConfig& c, int64_t call, int64_t mb) {
  return call * GlobalRound(c).microbatches + c.nodes.rank * Round(c).microbatches + mb;
}
// The weight of one microbatch's router load-balancing loss in the step's objective: the
// loss's weight over the step's microbatches (every node's), so the step adds their mean.
inline double RouterAuxWeight(const JobConfig& c) {
  return c.model.moe.aux_loss_weight /
         static_cast<double>(c.train.microbatches * c.train.accum_calls);
}
// Several nodes split the evaluation too when its microbatches divide evenly: node r evaluates
// the r-th block of train.eval_microbatches and the workers sum each eval job's loss across the
// nodes (else every node evaluates all of them).
inline bool EvalSplitAcrossNodes(const JobConfig& c) {
  return c.nodes.count > 1 && c.train.eval_microbatches % c.nodes.count == 0;
}
// Whether `c` can run on c.nodes.count nodes: the step's microbatches split evenly, and what the
// cross-node reduction does not cover (CUDA workers without the NCCL path, a plan that a node
// could change on its own) refused, naming the key.
Status CheckNodes(const JobConfig& c);

}  // namespace rp::core
