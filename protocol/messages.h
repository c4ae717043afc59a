// SPDX-License-Identifier: Apache-2.0
// The control-plane message set (coordinator <-> workers). Closed and versioned.
//
// Contract:
//  * Every frame is FrameHeader + exactly one payload POD; the payload size is fixed per type, so
//    a frame of the wrong size is rejected before any field is read (codec.h).
//  * Adding a message: add a MsgType value, a payload struct with static_asserts, an entry in the
//    Message variant, and bump kProtocolVersion. Switches over MsgType have no `default:`, so the
//    build breaks until every handler knows the new message.
//  * Bulk data never travels here: only indices, counters and timings. Tensors live in the shared
//    segment (shm/layout.h).
//  * Field semantics (job_index, microbatch) are validated by the receiver against its own state;
//    the codec validates framing and enum ranges only.
//
// Conversation:
//   worker -> Hello                    (after connecting)
//   coord  -> Welcome                  (segment to map) | Shutdown (refused)
//   coord  -> RunJob ...               (queued by the worker in arrival order = job order)
//   worker -> ActivationPool           (schedule.activations = "cuda_ipc": after Welcome,
//                                       the handle of the pool this worker's outputs go to)
//   coord  -> ActivationPool ...       (once every worker has sent its own: each peer's handle,
//                                       before the first RunJob)
//   coord  -> InputReady(job, mb)      (the job's input for microbatch mb is in its slot; with
//                                       activation pools, which workers' pools hold it)
//   worker -> MicrobatchDone(job, mb)  (outputs written; loss for the fused tail)
//   worker -> GradsReady(job)          (a tail/backward job holds its gradients)
//   coord  -> CommitGrads(job, acc)    (write, or add, them into the shared gradient slots now)
//   worker -> JobDone(job)             (everything the job writes is in shared memory; several
//                                       nodes: a fused tail's loss summed over the nodes)
//   worker -> JobFailed(job, text)     (the job cannot complete; the worker exits after)
//   worker -> Heartbeat                (at least every second from the worker's event loop; a
//                                       worker silent for job.worker_timeout_s is declared hung)
//   worker -> LinkProbe                (once, after joining: measured host-link bandwidth)
//   worker -> LayerTime ...            (jobs with RunJob.profile set: per layer and microbatch,
//                                       sent before that microbatch's MicrobatchDone)
//   coord  -> RunEval ...              (train.eval_every: one eval microbatch through every layer,
//                                       queued in job order like RunJob; its tokens are in eval
//                                       slot `slot`)
//   worker -> EvalDone(job, loss)      (summed cross-entropy and target count of that microbatch)
//   coord  -> StepUpdate(step)         (optimizer.device_update_blocks: the constants of the step's
//                                       update, once its norm is known, to every worker)
//   coord  -> Shutdown
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <variant>

namespace rp::proto {

inline constexpr uint32_t kFrameMagic = 0x31504d52;  // "RMP1"
inline constexpr uint16_t kProtocolVersion = 12;

enum class MsgType : uint16_t {
  kHello = 1,
  kWelcome = 2,
  kRunJob = 3,
  kInputReady = 4,
  kMicrobatchDone = 5,
  kGradsReady = 6,
  kCommitGrads = 7,
  kJobDone = 8,
  kJobFailed = 9,
  kShutdown = 10,
  kHeartbeat = 11,
  kLinkProbe = 12,
  kLayerTime = 13,
  kRunEval = 14,
  kEvalDone = 15,
  kActivationPool = 16,
  kStepUpdate = 17,
};
inline constexpr uint16_t kMinMsgType = 1;
inline constexpr uint16_t kMaxMsgType = 17;
const char* MsgTypeName(MsgType t);

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t payload_bytes;
  uint32_t reserved;
};
static_assert(sizeof(FrameHeader) == 16);

struct Hello {
  int32_t rank;
  int32_t pid;
  uint64_t layout_hash;  // the worker's own computation; must equal the coordinator's
  int32_t device_index;  // -1 for CPU
  uint32_t reserved;
};
static_assert(sizeof(Hello) == 24);

struct Welcome {
  uint64_t segment_bytes;
  int32_t num_workers;
  uint32_t reserved;
  char segment_name[64];  // NUL-terminated
};
static_assert(sizeof(Welcome) == 80);

struct RunJob {
  int64_t job_index;  // global launch counter (round-robin key)
  int64_t step;
  int32_t call;    // accumulation call inside the step
  int32_t stage;   // index into PipelinePlan::stages
  int32_t parity;  // activation slot set: global call % ArenaLayout::parities
  int32_t num_microbatches;
  double loss_scale;        // 1 / (non-ignored targets in the whole step)
  int64_t weights_version;  // fetch only after every used layer's version reaches this
  int32_t profile;          // 1: time every layer of every microbatch and send LayerTime
  uint32_t reserved;
};
static_assert(sizeof(RunJob) == 56);

// InputReady's source fields when the input is in the shared segment (host slots, token slots).
inline constexpr int32_t kFromHostSlot = -1;

struct InputReady {
  int64_t job_index;
  int32_t microbatch;
  // With activation pools (shm::ArenaLayout::activations is kCudaIpc): the rank whose pool holds
  // the hidden state the job starts from, and the one whose pool holds the incoming input
  // gradient (backward stages). kFromHostSlot where the input is not in a pool.
  int32_t hidden_rank;
  int32_t grad_rank;
  uint32_t reserved;
};
static_assert(sizeof(InputReady) == 24);

// MicrobatchDone.flags
inline constexpr uint32_t kMicrobatchLayerMajor = 1u;  // its job ran layer by layer over every
                                                       // microbatch: microbatch 0's interval is
                                                       // the whole job's, the others' near-empty
inline constexpr uint32_t kKnownMicrobatchFlags = kMicrobatchLayerMajor;

struct MicrobatchDone {
  int64_t job_index;
  int32_t microbatch;
  uint32_t flags;    // kMicrobatchLayerMajor
  double loss_sum;   // fused tail only: summed token cross-entropy (unscaled)
  int64_t targets;   // fused tail only: non-ignored labels in this microbatch
  int64_t start_us;  // wall clock, microseconds
  int64_t end_us;
};
static_assert(sizeof(MicrobatchDone) == 48);

struct GradsReady {
  int64_t job_index;
};
static_assert(sizeof(GradsReady) == 8);

struct CommitGrads {
  int64_t job_index;
  int32_t accumulate;  // 0: first commit of these slots in the step, overwrite; 1: add
  uint32_t reserved;
};
static_assert(sizeof(CommitGrads) == 16);

struct JobDone {
  int64_t job_index;
  int64_t start_us;      // job began (weight fetch)
  int64_t fetch_end_us;  // weights resident
  int64_t end_us;
  // Several nodes, fused tail jobs: the loss of this job summed over the same job of every node
  // (summed token cross-entropy, non-ignored labels); the step's loss is their sum. 0 otherwise.
  double nodes_loss_sum;
  int64_t nodes_targets;
  int64_t device_peak_bytes;  // the worker's peak of device memory held by tensors so far; -1: not
                              // tracked
};
static_assert(sizeof(JobDone) == 56);

struct JobFailed {
  int64_t job_index;
  char message[504];  // NUL-terminated
};
static_assert(sizeof(JobFailed) == 512);

struct Shutdown {
  int32_t exit_code;  // what the worker should exit with
  uint32_t reserved;
};
static_assert(sizeof(Shutdown) == 8);

struct Heartbeat {
  int64_t sent_us;  // wall clock, microseconds
};
static_assert(sizeof(Heartbeat) == 8);

// Host-link bandwidth the worker measured once between the shared segment and its device (for
// a CPU worker: host memory copies). Bytes per second; 0 if not measured.
struct LinkProbe {
  double h2d_bytes_per_s;
  double d2h_bytes_per_s;
  int64_t probe_bytes;
};
static_assert(sizeof(LinkProbe) == 24);

enum class LayerPhase : int32_t {
  kForward = 0,    // forward without autograd (forward stages)
  kRecompute = 1,  // forward with autograd (backward stages and the fused tail; for the head
                   // layer: its chunked forward, loss and backward together)
  kBackward = 2,   // backward through the layer (not the head: counted in kRecompute)
  kReplay = 3,     // forward with autograd whose attention came from the forward stage's record
                   // (schedule.keep_attention): no attention forward in it
};
inline constexpr int32_t kMaxLayerPhase = 3;

struct LayerTime {
  int64_t job_index;
  int32_t microbatch;
  int32_t layer;  // pipeline layer (0 = embedding, L + 1 = head)
  int32_t phase;  // LayerPhase
  uint32_t reserved;
  double seconds;       // device time (CUDA events on the compute stream; CPU: wall clock)
  int64_t saved_bytes;  // device memory the layer's autograd forward left allocated (its
                        // saved activations and output); -1 where not measured (CPU)
};
static_assert(sizeof(LayerTime) == 40);

// Evaluation of one eval microbatch with the weights holding `weights_version` updates: every
// layer forward (no autograd, no dropout) and the head's loss. It shares the job_index sequence
// with RunJob, so a worker's queue keeps one order.
struct RunEval {
  int64_t job_index;
  int64_t step;             // 0-based step after whose update the eval runs
  int64_t weights_version;  // = step + 1
  int32_t slot;             // eval token/label slot (shm/layout.h)
  uint32_t reserved;
};
static_assert(sizeof(RunEval) == 32);

struct EvalDone {
  int64_t job_index;
  double loss_sum;  // summed token cross-entropy
  int64_t targets;  // labels != -100
  int64_t start_us, end_us;
};
static_assert(sizeof(EvalDone) == 40);

// One worker's activation pool (schedule.activations = "cuda_ipc"): sent by the worker
// that owns it, then by the coordinator to every other worker. `handle` is opaque to everyone but
// the workers' device backend: a cudaIpcMemHandle_t for CUDA workers (64 bytes), a
// NUL-terminated shared-memory name for CPU workers.
struct ActivationPool {
  int32_t rank;          // owner
  int32_t device_index;  // owner's CUDA device, -1 for CPU
  uint64_t bytes;        // must equal the layout's pool_bytes
  char handle[64];
};
static_assert(sizeof(ActivationPool) == 80);

// optimizer.device_update_blocks: what step `step`'s AdamW update uses, the same values the
// coordinator's optimizer uses (gpu_worker/device_update.h). Sent once the step's norm is known.
struct StepUpdate {
  int64_t step;
  int64_t adam_step;  // 1-based count of updates applied, this one included
  double lr;
  float grad_scale;  // clip scale: what the update multiplies gradients by
  uint32_t reserved;
};
static_assert(sizeof(StepUpdate) == 32);

using Message = std::variant<Hello, Welcome, RunJob, InputReady, MicrobatchDone, GradsReady,
                             CommitGrads, JobDone, JobFailed, Shutdown, Heartbeat, LinkProbe,
                             LayerTime, RunEval, EvalDone, ActivationPool, StepUpdate>;

template <typename T>
constexpr MsgType TypeOf();
template <>
constexpr MsgType TypeOf<Hello>() {
  return MsgType::kHello;
}
template <>
constexpr MsgType TypeOf<Welcome>() {
  return MsgType::kWelcome;
}
template <>
constexpr MsgType TypeOf<RunJob>() {
  return MsgType::kRunJob;
}
template <>
constexpr MsgType TypeOf<InputReady>() {
  return MsgType::kInputReady;
}
template <>
constexpr MsgType TypeOf<MicrobatchDone>() {
  return MsgType::kMicrobatchDone;
}
template <>
constexpr MsgType TypeOf<GradsReady>() {
  return MsgType::kGradsReady;
}
template <>
constexpr MsgType TypeOf<CommitGrads>() {
  return MsgType::kCommitGrads;
}
template <>
constexpr MsgType TypeOf<JobDone>() {
  return MsgType::kJobDone;
}
template <>
constexpr MsgType TypeOf<JobFailed>() {
  return MsgType::kJobFailed;
}
template <>
constexpr MsgType TypeOf<Shutdown>() {
  return MsgType::kShutdown;
}
template <>
constexpr MsgType TypeOf<Heartbeat>() {
  return MsgType::kHeartbeat;
}
template <>
constexpr MsgType TypeOf<LinkProbe>() {
  return MsgType::kLinkProbe;
}
template <>
constexpr MsgType TypeOf<LayerTime>() {
  return MsgType::kLayerTime;
}
template <>
constexpr MsgType TypeOf<RunEval>() {
  return MsgType::kRunEval;
}
template <>
constexpr MsgType TypeOf<EvalDone>() {
  return MsgType::kEvalDone;
}
template <>
constexpr MsgType TypeOf<ActivationPool>() {
  return MsgType::kActivationPool;
}
template <>
constexpr MsgType TypeOf<StepUpdate>() {
  return MsgType::kStepUpdate;
}

}  // namespace rp::proto
