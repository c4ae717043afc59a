// SPDX-License-Identifier: Apache-2.0
// Device: the seam between the worker and the hardware it computes on.
//
// Contract:
//  * Moves bytes between the shared segment and tensors on the device: weight fetch (possibly
//    ahead of time), activation load/store, gradient write-back. Everything the executor does to
//    shared memory goes through here; a backend decides how (plain copies on CPU; pinned DMA on
//    prioritized streams for CUDA).
//  * Ordering: layer compute runs on the backend's compute stream (LibTorch's current stream).
//    FetchActivation() returns a tensor the compute stream may use at once. FetchWeights()
//    may still be copying when it returns: the compute stream waits for it only when the fence
//    returned by WeightsFence() is passed to WaitWeights(), so prefetching the next job's
//    weights never delays the current job's kernels. A tensor dropped while its copy may still
//    run must be waited for first (WaitWeights), or the compute stream may reuse its memory.
//  * Store() is asynchronous: its bytes are in shared memory once Synchronize() returns, or once
//    Completed() is true for a CompletionFence() taken after it.
//    Gradient commits run on their own path (StartCommit / CommitDone) so that a job's
//    gradient write-back overlaps the next job's compute instead of stalling it.
//  * The CPU backend is first-class: it is what CI runs, and the oracle the CUDA backend is
//    compared with.
//  * One Device per worker process; used by one thread.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "optim/adamw.h"
#include "model/fused_kernels.h"
#include "nodes/node_reduction.h"

namespace rp::worker {

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string Describe() const = 0;
  virtual at::Device torch_device() const = 0;
  // The backend's fused kernels for the model's hot spots, or null (CPU: the composite ops are
  // the oracle). Lives as long as the process.
  virtual const model::FusedKernels* fused_kernels() const { return nullptr; }

  // `src` holds `stored` elements; the tensor returned holds them in `dtype`. The two differ only
  // when workers fetch the fp32 masters (shm::ArenaLayout::masters_in_state) for bf16 compute:
  // the rounding is round-to-nearest-even, bit for bit what the optimizer writes into a compute
  // copy (so both sources give the same weights).
  at::Tensor FetchWeights(const void* src, at::IntArrayRef shape, at::ScalarType stored,
                          at::ScalarType dtype) {
    at::Tensor t = EmptyWeights(shape, dtype);
    CopyWeights(t, src, stored);
    return t;
  }
  // FetchWeights in two parts. EmptyWeights() makes the destination. The CUDA backend takes it
  // from the compute stream's pool (a pool of its own for weights held 3 GiB more device memory
  // on the Qwen3-4B job: neither pool reuses the other's free memory) and so, at this call,
  // makes the weights stream wait for the compute work queued so far, which may still read the
  // memory. Make a stage's destinations before its compute is queued, and their copies never
  // wait for it. CopyWeights() enqueues the copy (with the conversion above) into `dst`.
  virtual at::Tensor EmptyWeights(at::IntArrayRef shape, at::ScalarType dtype) = 0;
  virtual void CopyWeights(const at::Tensor& dst, const void* src, at::ScalarType stored) = 0;
  // A tensor on this device over `src` in place (no copy): `shape` elements of `stored`, read
  // by kernels straight from the shared segment (CUDA: through the host link, as mapped pinned
  // memory). For a table of which a kernel reads a small part (an embedding's looked-up rows).
  // Only the parts the caller knows to be stable may be read through it (the rows of the job's
  // tokens: the optimizer may be writing the table's other rows meanwhile); an operation over
  // the whole tensor would race with those writes.
  virtual at::Tensor MapWeights(const void* src, at::IntArrayRef shape, at::ScalarType stored) = 0;
  virtual uint64_t WeightsFence() = 0;
  virtual void WaitWeights(uint64_t fence) = 0;

  virtual at::Tensor FetchActivation(const void* src, at::IntArrayRef shape,
                                     at::ScalarType dtype) = 0;
  // Writes `t` converted to `dtype` to `dst`.
  virtual void Store(const at::Tensor& t, void* dst, at::ScalarType dtype) = 0;
  // Blocks until every Store() issued so far is in shared memory.
  virtual void Synchronize() = 0;
  // Non-blocking completion of everything enqueued so far (compute, Store(), pool copies): the
  // worker enqueues the next microbatch at once and reports this one done when Completed(ticket)
  // says so, so the device never idles between microbatches waiting for the host. Tickets
  // complete in order; Completed() throws on a device error.
  virtual uint64_t CompletionFence() = 0;
  virtual bool Completed(uint64_t ticket) = 0;

  // Activation pools (schedule.activations = "cuda_ipc", shm::ArenaLayout::pool_bytes):
  // a worker creates its own pool once and announces the returned handle; it opens each peer's
  // pool once from the handle the coordinator relays. Offsets are from a pool's base
  // (ArenaLayout::PoolHiddenSlot). StoreToPool() writes into this worker's pool and is complete
  // once Synchronize() returns (or a later fence completes), like Store(); FetchFromPool() copies
  // out of any opened pool (this worker's own included) into a new tensor the compute stream may
  // use at once, like FetchActivation(), and has finished reading the pool once Synchronize()
  // returns (or a later fence completes). CUDA: device memory exported with cudaIpcGetMemHandle,
  // opened by peers on the same GPU or on GPUs with peer access. CPU: a named shared-memory object
  // (`name`) whose header carries `layout_hash`, so a peer from another run or build is refused.
  // Pools live as long as the device; an offset or rank outside them throws.
  using PoolHandle = std::array<char, 64>;
  virtual StatusOr<PoolHandle> CreatePool(int rank, uint64_t bytes, uint64_t layout_hash,
                                          const std::string& name) = 0;
  virtual Status OpenPeerPool(int rank, const PoolHandle& handle, uint64_t bytes,
                              uint64_t layout_hash) = 0;
  virtual at::Tensor FetchFromPool(int rank, uint64_t offset, at::IntArrayRef shape,
                                   at::ScalarType dtype) = 0;
  virtual void StoreToPool(const at::Tensor& t, uint64_t offset, at::ScalarType dtype) = 0;

  // Gradient write-back, asynchronous so the next job can compute meanwhile: writes each fp32
  // tensor to its destination (accumulate = false) or adds it there (accumulate = true). The
  // device keeps the tensors alive until CommitDone(ticket) returns true, after which the bytes
  // are in shared memory.
  struct CommitItem {
    at::Tensor grad;
    float* dst;
  };
  virtual uint64_t StartCommit(std::vector<CommitItem> items, bool accumulate) = 0;
  virtual bool CommitDone(uint64_t ticket) = 0;
  // Squared sums of finished fp32 gradients (ExecutionPlan::gradients_wait_in_workers, share-sized
  // slots): for each item, out[i] becomes the sum of the squares of elements [i x chunk, (i + 1) x
  // chunk) of grad flattened, in double, for every chunk. Asynchronous, so that the worker goes on
  // queueing the next job meanwhile: the values are in every `out` once SquaresDone(ticket) has
  // returned true; the device keeps the gradients alive until then. The gradients must be
  // complete when this is called, with no work on them queued since (their microbatches'
  // completion fences have passed, or, for gradients summed across nodes, the sum's Poll() was
  // true): the CUDA backend sums them on its gradients stream without waiting for the compute
  // stream, which may hold the next job's work. The CPU backend sums exactly as the coordinator's
  // optimizer does (the same bits), at once; the CUDA backend in another order.
  struct SquaresItem {
    at::Tensor grad;
    double* out;
  };
  virtual uint64_t StartChunkSquares(std::vector<SquaresItem> items, int64_t chunk) = 0;
  virtual bool SquaresDone(uint64_t ticket) = 0;

  // Device updates (optimizer.device_update_blocks, gpu_worker/device_update.h).
  // PinReadOnly() makes [base, base + bytes) of a read-only mapping (the optimizer segment) fast to
  // copy from for as long as the device lives (CUDA: registered for DMA, read-only; CPU: nothing
  // to do); FetchWeights() with stored == dtype == kFloat then copies its fp32 arrays.
  // AdamWComputeCopy() queues on the compute stream what coord::AdamWUpdate writes into a compute
  // copy with UpdateWrites::kFetched: `out` (bf16 or fp32) gets the updated master, bit for bit.
  // grad, master, m and v are contiguous fp32 tensors on this device with out's element count; none
  // of them is written.
  virtual Status PinReadOnly(const void* base, uint64_t bytes) = 0;
  virtual void AdamWComputeCopy(const coord::AdamWHyper& h, float grad_scale,
                                const at::Tensor& grad, const at::Tensor& master,
                                const at::Tensor& m, const at::Tensor& v,
                                const at::Tensor& out) = 0;

  // Profiling (planning/profile.h). Mark() records how far the compute stream has got and returns
  // the mark's index; MarkSeconds(a, b) is the device time between two marks (it waits for mark
  // b). ClearMarks() forgets every mark. Marks cost no synchronization while recording.
  virtual int Mark() = 0;
  virtual double MarkSeconds(int a, int b) = 0;
  virtual void ClearMarks() = 0;
  // Bytes of device memory held by live tensors now, or -1 where not tracked (CPU).
  virtual int64_t AllocatedBytes() { return -1; }
  // The peak of AllocatedBytes() since the process started, or -1 where not tracked.
  virtual int64_t PeakAllocatedBytes() { return -1; }
  // Peak device memory so far, for the log; empty where not tracked.
  virtual std::string MemoryReport() { return ""; }
  // Host-link bandwidth in bytes per second each way, measured by copying `bytes` of `src`
  // (inside the shared segment, only read) to the device and back into private host memory.
  struct LinkRates {
    double h2d_bytes_per_s = 0.0;
    double d2h_bytes_per_s = 0.0;
  };
  virtual StatusOr<LinkRates> ProbeLink(const void* src, uint64_t bytes) = 0;
};

std::unique_ptr<Device> MakeCpuDevice();

// Number of CUDA devices this build can use (0 without CUDA support or without a GPU).
int CudaDeviceCount();
// The CUDA backend for device `index`, with the shared segment [base, base + bytes) pinned for
// DMA. Unavailable in builds without CUDA.
// `memory_limit_bytes` > 0 caps LibTorch's caching allocator on the device at that many bytes
// (job.device_memory_limit_gib); a limit above the device's memory is refused.
StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int index, void* base, uint64_t bytes,
                                                 uint64_t memory_limit_bytes = 0);

// Several nodes with CUDA workers: worker `worker_rank`'s group for `purpose` over NCCL (c10d's
// ProcessGroupNCCL), its tensors on GPU `device_index`, on the store nodes::NodeReduction::Join
// uses (one node: an in-process store). Fails naming the group, or in a build without NCCL
// saying so (NcclAvailable()).
bool NcclAvailable();
StatusOr<std::unique_ptr<nodes::NodeReduction>> JoinNcclGroup(const nodes::NodeGroup& group,
                                                              int worker_rank,
                                                              const std::string& purpose,
                                                              int device_index);

}  // namespace rp::worker
