// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the worker (compiled only when RP_WITH_CUDA is on).
//
// Streams (all non-blocking, so none synchronizes implicitly with LibTorch's compute stream):
//   weights      low priority: H2D of stage weights, in chunks, usually for the *next* job
//   activations  high priority: H2D of the current microbatch's inputs
//   d2h          D2H of outputs and checkpoints (what the next stage waits for)
//   grads        low priority: D2H of a finished job's gradients, overlapping the next job
// An accumulating commit (a later call of the step) first brings the slot's current value in and
// adds on the GPU, all on the grads stream: PCIe both ways costs less than a CPU pass over the
// slot, and the compute stream never waits for it. A committer thread waits for each gradient copy
// so the compute thread never blocks. Compute runs on LibTorch's current stream of the device (the
// default stream). Every copy into a freshly allocated tensor first waits for the compute stream's
// progress so far, because the caching allocator may hand out memory that queued kernels still
// read; except an activation fetch, whose tensor comes from the activations stream's own pool (and
// is marked as used by the compute stream), so the next microbatch's input arrives while this one
// computes. The caching allocator's statistics and stream pools need the CUDA LibTorch's generated
// headers. A CPU LibTorch lacks them; such a build only compile-checks this backend
// (AllocatedBytes() then reports "not tracked", and OnStream does nothing).
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define RP_HAVE_CUDA_LIBTORCH 1
#else
#define RP_HAVE_CUDA_LIBTORCH 0
#endif
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "common/test_hooks.h"
#include "gpu_worker/cuda/cuda_check.h"
#include "gpu_worker/cuda/cuda_handles.h"
#include "gpu_worker/cuda/fused_kernels.h"
#include "gpu_worker/cuda/kernels.h"
#include "gpu_worker/device.h"

namespace rp::worker {
namespace {

constexpr cudaStream_t kComputeStream = nullptr;  // LibTorch's default stream
constexpr uint64_t kChunkBytes = 64ull << 20;     // lets activation copies pass weight copies

void LogIfError(cudaError_t e, const char* what) {
  if (e != cudaSuccess) RP_LOG(ERROR) << what << ": " << cudaGetErrorString(e);
}

// Pins [base, base + bytes) for DMA for its lifetime; never throws.
class HostRegistration {
 public:
  static StatusOr<HostRegistration> Create(void* base, uint64_t bytes) {
    // Mapped too: Device::MapWeights hands kernels pointers into it.
    RP_CUDA_RETURN_IF_ERROR(
        cudaHostRegister(base, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    return HostRegistration(base);
  }
  // A mapping the process may only read (PROT_READ): DMA reads it, nothing writes it.
  static StatusOr<HostRegistration> CreateReadOnly(void* base, uint64_t bytes) {
    RP_CUDA_RETURN_IF_ERROR(
        cudaHostRegister(base, bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly));
    return HostRegistration(base);
  }
  HostRegistration(HostRegistration&& o) noexcept : base_(o.base_) { o.base_ = nullptr; }
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration() {
    if (base_) LogIfError(cudaHostUnregister(base_), "cudaHostUnregister");
  }

 private:
  explicit HostRegistration(void* base) : base_(base) {}
  void* base_;
};

// Device memory from cudaMalloc (not the caching allocator: CUDA IPC exports whole
// allocations); freed on destruction, never throws.
class DeviceAllocation {
 public:
  DeviceAllocation() = default;
  explicit DeviceAllocation(void* p) : p_(p) {}
  DeviceAllocation(DeviceAllocation&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  DeviceAllocation& operator=(DeviceAllocation&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  ~DeviceAllocation() {
    if (p_) LogIfError(cudaFree(p_), "cudaFree(activation pool)");
  }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

// A peer's exported memory mapped into this process; unmapped on destruction, never throws.
class IpcMapping {
 public:
  explicit IpcMapping(void* p) : p_(p) {}
  IpcMapping(IpcMapping&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  IpcMapping& operator=(IpcMapping&&) = delete;
  ~IpcMapping() {
    if (p_) LogIfError(cudaIpcCloseMemHandle(p_), "cudaIpcCloseMemHandle(peer activation pool)");
  }
  void* get() const { return p_; }

 private:
  void* p_;
};

// While alive, LibTorch's current stream on the device is `s`: allocations come from that
// stream's pool and LibTorch ops run on it. UsedByCurrent() (called outside any OnStream) marks a
// tensor so the allocator does not hand its memory out again before the current (compute)
// stream's work queued so far is done.
class OnStream {
 public:
#if RP_HAVE_CUDA_LIBTORCH
  OnStream(cudaStream_t s, int index)
      : guard_(c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(index))) {}
  static void UsedByCurrent(const at::Tensor& t, int index) {
    c10::cuda::CUDACachingAllocator::recordStream(
        t.storage().data_ptr(),
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)));
  }

 private:
  c10::cuda::CUDAStreamGuard guard_;
#else
  OnStream(cudaStream_t, int) {}
  static void UsedByCurrent(const at::Tensor&, int) {}
#endif
};

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(Device::PoolHandle),
              "a CUDA IPC handle travels in ActivationPool::handle");

void ThrowIfError(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(CudaStatus(e, call).message());
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int index, HostRegistration reg) : index_(index), registration_(std::move(reg)) {}

  Status Init() {
    int least = 0, greatest = 0;
    RP_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    RP_ASSIGN_OR_RETURN(weights_stream_, CudaStream::Create(least));
    RP_ASSIGN_OR_RETURN(acts_stream_, CudaStream::Create(greatest));
    RP_ASSIGN_OR_RETURN(d2h_stream_, CudaStream::Create(greatest));
    RP_ASSIGN_OR_RETURN(grads_stream_, CudaStream::Create(least));
    weights_ = weights_stream_.get();
    acts_ = acts_stream_.get();
    d2h_ = d2h_stream_.get();
    grads_ = grads_stream_.get();
    committer_ = std::thread([this] { CommitterLoop(); });
    return Status::Ok();
  }

  ~CudaDevice() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (committer_.joinable()) committer_.join();
    // The events (EventPool) and streams (CudaStream) go with their owners, after this.
    LogIfError(cudaDeviceSynchronize(), "cudaDeviceSynchronize at worker exit");
  }

  std::string Describe() const override {
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, index_);
    return "cuda:" + std::to_string(index_) + " (" + p.name + ")";
  }
  at::Device torch_device() const override { return at::Device(at::kCUDA, index_); }
  const model::FusedKernels* fused_kernels() const override { return &CudaKernels(); }

  at::Tensor EmptyWeights(at::IntArrayRef shape, at::ScalarType dtype) override {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype).device(torch_device()));
    StreamWaitsForCompute(weights_);
    return t;
  }

  at::Tensor MapWeights(const void* src, at::IntArrayRef shape, at::ScalarType stored) override {
    void* on_device = nullptr;
    const cudaError_t e = cudaHostGetDevicePointer(&on_device, const_cast<void*>(src), 0);
    if (e != cudaSuccess)
      throw std::runtime_error(
          std::string("MapWeights: no device address for the shared segment: ") +
          cudaGetErrorString(e));
    // target_device: LibTorch would otherwise ask the pointer which device it lives on, and
    // host memory has none.
    return at::for_blob(on_device, shape)
        .options(at::TensorOptions().dtype(stored).device(torch_device()))
        .target_device(torch_device())
        .make_tensor();
  }

  void CopyWeights(const at::Tensor& t, const void* src, at::ScalarType stored) override {
    const at::ScalarType dtype = t.scalar_type();
    if (stored == dtype) {
      CopyChunked(t.data_ptr(), src, t.nbytes(), cudaMemcpyHostToDevice, weights_);
      return;
    }
    if (stored != at::kFloat || (dtype != at::kBFloat16 && dtype != at::kHalf))
      throw std::runtime_error(std::string("CopyWeights: no conversion from ") +
                               c10::toString(stored) + " to " + c10::toString(dtype));
    // fp32 masters for bf16 compute: each chunk lands in one staging buffer and is rounded into
    // t, both on the weights stream. The next chunk's copy waits for the rounding, a few percent
    // of the copy's time in memory traffic (though the kernel shares the SMs with the compute
    // stream's), so one buffer is enough and nothing syncs the host; it is no slower than
    // fetching a bf16 copy (docs/benchmarks.md, "Measurements behind the code's choices").
    constexpr int64_t kChunkElems = static_cast<int64_t>(kChunkBytes / sizeof(float));
    if (!staging_.defined()) {
      OnStream on_weights(weights_, index_);  // only the weights stream ever touches it
      staging_ =
          at::empty({kChunkElems}, at::TensorOptions().dtype(at::kFloat).device(torch_device()));
    }
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<uint16_t*>(t.data_ptr());
    for (int64_t off = 0; off < t.numel(); off += kChunkElems) {
      const int64_t n = std::min(kChunkElems, t.numel() - off);
      ThrowIfError(
          cudaMemcpyAsync(staging_.data_ptr(), in + off, static_cast<size_t>(n) * sizeof(float),
                          cudaMemcpyHostToDevice, weights_),
          "cudaMemcpyAsync(master weights H2D)");
      if (dtype == at::kBFloat16) {
        ThrowIfError(kernels::RoundToBFloat16(staging_.data_ptr<float>(), out + off, n, weights_),
                     "RoundToBFloat16(master weights)");
      } else {
        // fp16: LibTorch's conversion, on the weights stream like the copy before it.
        OnStream on_weights(weights_, index_);
        t.view({-1}).narrow(0, off, n).copy_(staging_.narrow(0, 0, n), /*non_blocking=*/true);
      }
    }
  }

  uint64_t StartChunkSquares(std::vector<SquaresItem> items, int64_t chunk) override {
    // On the gradients stream with no wait for the compute stream: the gradients are complete
    // (Device's contract) and the compute stream may hold the next job's work. A slice of chunks
    // at a time so the squares' temporary stays small; one copy of all results to pinned memory.
    auto q = std::make_unique<Squares>();
    q->ticket = ++squares_counter_;
    OnStream on_grads(grads_, index_);
    std::vector<at::Tensor> parts;
    int64_t total = 0;
    for (const auto& it : items) {
      const at::Tensor flat = it.grad.contiguous().view({-1});
      const int64_t n = flat.numel(), chunks = (n + chunk - 1) / chunk, whole = n / chunk;
      constexpr int64_t kSliceChunks = 64;
      for (int64_t c = 0; c < whole; c += kSliceChunks) {
        const int64_t k = std::min(kSliceChunks, whole - c);
        parts.push_back(flat.narrow(0, c * chunk, k * chunk)
                            .view({k, chunk})
                            .square()
                            .sum(1, false, at::kDouble));
      }
      if (whole < chunks)
        parts.push_back(
            flat.narrow(0, whole * chunk, n - whole * chunk).square().sum(at::kDouble).view({1}));
      q->outs.push_back({it.out, chunks});
      total += chunks;
    }
    if (total > 0) {
      q->sums = at::cat(parts);
      q->host = at::empty({total}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
      ThrowIfError(cudaMemcpyAsync(q->host.data_ptr(), q->sums.data_ptr(), q->host.nbytes(),
                                   cudaMemcpyDeviceToHost, grads_),
                   "cudaMemcpyAsync(gradient squares D2H)");
    }
    q->items = std::move(items);
    q->event = TakeEvent();
    ThrowIfError(cudaEventRecord(q->event, grads_), "cudaEventRecord(gradient squares)");
    const uint64_t ticket = q->ticket;
    squares_.emplace(ticket, std::move(q));
    return ticket;
  }

  bool SquaresDone(uint64_t ticket) override {
    auto it = squares_.find(ticket);
    if (it == squares_.end()) return true;
    Squares& q = *it->second;
    if (!EventDone(q.event, "cudaEventQuery(gradient squares)")) return false;
    const double* src = q.host.defined() ? q.host.data_ptr<double>() : nullptr;
    for (const auto& [out, count] : q.outs) {
      if (count == 0) continue;
      std::memcpy(out, src, static_cast<size_t>(count) * sizeof(double));
      src += count;
    }
    events_.Give(q.event);
    squares_.erase(
        it);  // the gradients and temporaries go back to their pools after the copy ended
    return true;
  }

  uint64_t WeightsFence() override {
    cudaEvent_t e = TakeEvent();
    ThrowIfError(cudaEventRecord(e, weights_), "cudaEventRecord(weights)");
    fences_.push_back({++fence_counter_, e});
    return fence_counter_;
  }

  void WaitWeights(uint64_t fence) override {
    while (!fences_.empty() && fences_.front().id <= fence) {
      ThrowIfError(cudaStreamWaitEvent(kComputeStream, fences_.front().event, 0),
                   "cudaStreamWaitEvent(compute, weights)");
      events_.Give(fences_.front().event);
      fences_.pop_front();
    }
  }

  // Test hook: with RP_TEST_CUDA_FAULT_ONCE=<marker path>, one worker of the run
  // (common/test_hooks.h) launches a kernel that faults (a write to an unmapped address, which
  // poisons its CUDA context) at its 8th activation fetch. What follows is the real failure
  // path: the error surfaces at the next synchronization, the job fails, the worker exits and
  // is replaced.
  void MaybeInjectFaultForTest() {
    if (++fetches_ != 8 || !ClaimTestHookOnce("RP_TEST_CUDA_FAULT_ONCE")) return;
    RP_LOG(WARNING) << "RP_TEST_CUDA_FAULT_ONCE: launching a faulting kernel on purpose";
    // A fill kernel writing through a pointer that maps nothing: an illegal address.
    at::Tensor wild = at::from_blob(reinterpret_cast<void*>(uintptr_t{0x1000}), {1 << 20},
                                    at::TensorOptions().dtype(at::kFloat).device(torch_device()));
    wild.fill_(1.0f);
  }
  int64_t fetches_ = 0;

  at::Tensor FetchActivation(const void* src, at::IntArrayRef shape,
                             at::ScalarType dtype) override {
    MaybeInjectFaultForTest();
    at::Tensor t;
    {
      // Memory from the activations stream's pool is never in use by queued compute kernels, so
      // the copy need not wait for them; UsedByCurrent keeps it from reuse until the compute
      // stream's reads (enqueued after this) are done.
      OnStream on_acts(acts_, index_);
      t = at::empty(shape, at::TensorOptions().dtype(dtype).device(torch_device()));
    }
    OnStream::UsedByCurrent(t, index_);
    ThrowIfError(cudaMemcpyAsync(t.data_ptr(), src, t.nbytes(), cudaMemcpyHostToDevice, acts_),
                 "cudaMemcpyAsync(activation H2D)");
    ComputeWaitsFor(acts_);
    return t;
  }

  void Store(const at::Tensor& t, void* dst, at::ScalarType dtype) override {
    at::Tensor src = t.detach().to(dtype).contiguous();
    StreamWaitsForCompute(d2h_);
    ThrowIfError(cudaMemcpyAsync(dst, src.data_ptr(), src.nbytes(), cudaMemcpyDeviceToHost, d2h_),
                 "cudaMemcpyAsync(D2H)");
    PendingStore p;
    p.copied = TakeEvent();
    ThrowIfError(cudaEventRecord(p.copied, d2h_), "cudaEventRecord(store)");
    p.source = std::move(src);
    pending_store_bytes_ += p.source.nbytes();
    pending_stores_.push_back(std::move(p));
    ReleaseStoredSources();
  }

  void Synchronize() override {
    ThrowIfError(cudaStreamSynchronize(d2h_), "cudaStreamSynchronize(d2h)");
    DropPendingStores();
    // Pool copies run on the compute stream. A store must be complete before a peer may read it;
    // a read from a peer's pool before the owner may overwrite that slot (the owner rewrites it
    // only after this worker's MicrobatchDone or JobDone). The worker's microbatches rely on
    // CompletionFence() for the same; this is the blocking form (evaluation, tests).
    if (pool_copies_pending_)
      ThrowIfError(cudaStreamSynchronize(kComputeStream), "cudaStreamSynchronize(compute)");
    pool_copies_pending_ = false;
  }

  uint64_t CompletionFence() override {
    Completion c;
    c.id = ++completion_counter_;
    // Pool copies run on the compute stream, activation stores on d2h_: one event on each.
    c.compute = TakeEvent();
    ThrowIfError(cudaEventRecord(c.compute, kComputeStream),
                 "cudaEventRecord(completion, compute)");
    c.d2h = TakeEvent();
    ThrowIfError(cudaEventRecord(c.d2h, d2h_), "cudaEventRecord(completion, d2h)");
    for (auto& p : pending_stores_) c.keep_alive.push_back(std::move(p.source));
    DropPendingStores();
    pool_copies_pending_ = false;
    completions_.push_back(std::move(c));
    return completion_counter_;
  }

  bool Completed(uint64_t ticket) override {
    while (!completions_.empty() && completions_.front().id <= ticket) {
      Completion& c = completions_.front();
      if (!EventDone(c.compute, "cudaEventQuery(completion, compute)") ||
          !EventDone(c.d2h, "cudaEventQuery(completion, d2h)"))
        return false;
      events_.Give(c.compute);
      events_.Give(c.d2h);
      completions_.pop_front();
    }
    return true;
  }

  StatusOr<PoolHandle> CreatePool(int rank, uint64_t bytes, uint64_t, const std::string&) override {
    if (own_pool_.get()) return Status::Internal("this worker's activation pool exists already");
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
      cudaGetLastError();
      return Status::Unavailable(
          "allocating worker " + std::to_string(rank) + "'s activation pool (" +
          std::to_string(bytes >> 20) +
          " MiB of device memory, schedule.activations = \"cuda_ipc\"): " + cudaGetErrorString(e) +
          "; use activations = \"host\", or fewer/smaller microbatches");
    }
    own_pool_ = DeviceAllocation(p);
    cudaIpcMemHandle_t h;
    RP_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, p));
    PoolHandle out{};
    std::memcpy(out.data(), &h, sizeof(h));
    own_rank_ = rank;
    pool_bytes_ = bytes;
    return out;
  }

  Status OpenPeerPool(int rank, const PoolHandle& handle, uint64_t bytes, uint64_t) override {
    if (bytes != pool_bytes_)
      return Status::ProtocolError("activation pool of worker " + std::to_string(rank) + " has " +
                                   std::to_string(bytes) + " bytes, this worker's has " +
                                   std::to_string(pool_bytes_));
    if (rank == own_rank_ || peers_.count(rank))
      return Status::ProtocolError("activation pool of worker " + std::to_string(rank) +
                                   " announced twice");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess) {
      cudaGetLastError();
      return Status::Unavailable(
          "opening worker " + std::to_string(rank) + "'s activation pool on cuda:" +
          std::to_string(index_) + " (cudaIpcOpenMemHandle: " + cudaGetErrorString(e) +
          "): CUDA IPC needs both workers on one GPU or on GPUs with peer access; use "
          "schedule.activations = \"host\"");
    }
    peers_.emplace(rank, IpcMapping(p));
    return Status::Ok();
  }

  at::Tensor FetchFromPool(int rank, uint64_t offset, at::IntArrayRef shape,
                           at::ScalarType dtype) override {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype).device(torch_device()));
    const char* src = PoolBytes(rank, offset, t.nbytes());
    // On the compute stream: a device-to-device copy of one slot takes microseconds (same GPU) to
    // a few hundred (NVLink), and the layer that reads it would wait for it anyway.
    ThrowIfError(cudaMemcpyAsync(t.data_ptr(), src, t.nbytes(), cudaMemcpyDefault, kComputeStream),
                 "cudaMemcpyAsync(activation pool -> device)");
    pool_copies_pending_ = true;
    return t;
  }

  void StoreToPool(const at::Tensor& t, uint64_t offset, at::ScalarType dtype) override {
    // The converted temporary is freed right after; the allocator reuses it only in compute
    // stream order, after this copy.
    at::Tensor src = t.detach().to(dtype).contiguous();
    char* dst = const_cast<char*>(PoolBytes(own_rank_, offset, src.nbytes()));
    ThrowIfError(cudaMemcpyAsync(dst, src.data_ptr(), src.nbytes(), cudaMemcpyDeviceToDevice,
                                 kComputeStream),
                 "cudaMemcpyAsync(device -> activation pool)");
    pool_copies_pending_ = true;
  }

  uint64_t StartCommit(std::vector<CommitItem> items, bool accumulate) override {
    auto c = std::make_shared<Commit>();
    c->ticket = ++commit_counter_;
    for (auto& it : items) it.grad = it.grad.detach().to(at::kFloat).contiguous();
    // Everything below reads the gradients the compute stream produced so far.
    StreamWaitsForCompute(grads_);
    if (accumulate) {
      // The slot holds the earlier calls' sum; the coordinator granted this commit only after
      // that sum was complete in shared memory.
      // All on the gradients stream: bringing the slot in (up to the whole model's fp32
      // gradients per call) must not stall the compute stream, which has the next job queued.
      // The sums live in `items` until the commit is done; the temporaries come from this
      // stream's pool, so their reuse is ordered after the adds.
      OnStream on_grads(grads_, index_);
      for (auto& it : items) {
        at::Tensor current = at::empty_like(it.grad);
        ThrowIfError(cudaMemcpyAsync(current.data_ptr(), it.dst, current.nbytes(),
                                     cudaMemcpyHostToDevice, grads_),
                     "cudaMemcpyAsync(gradient slot H2D)");
        it.grad.add_(current);
      }
    }
    for (auto& it : items)
      ThrowIfError(cudaMemcpyAsync(it.dst, it.grad.data_ptr(), it.grad.nbytes(),
                                   cudaMemcpyDeviceToHost, grads_),
                   "cudaMemcpyAsync(gradient D2H)");
    c->items = std::move(items);
    c->event = TakeEvent();
    ThrowIfError(cudaEventRecord(c->event, grads_), "cudaEventRecord(grads)");
    {
      std::lock_guard<std::mutex> l(mu_);
      inflight_[c->ticket] = c;
      to_finish_.push_back(c);
    }
    cv_.notify_all();
    return c->ticket;
  }

  int Mark() override {
    cudaEvent_t e = timing_events_.Take();
    ThrowIfError(cudaEventRecord(e, kComputeStream), "cudaEventRecord(mark)");
    marks_.push_back(e);
    return static_cast<int>(marks_.size()) - 1;
  }

  double MarkSeconds(int a, int b) override {
    ThrowIfError(cudaEventSynchronize(marks_.at(b)), "cudaEventSynchronize(mark)");
    float ms = 0.0f;
    ThrowIfError(cudaEventElapsedTime(&ms, marks_.at(a), marks_.at(b)), "cudaEventElapsedTime");
    return ms * 1e-3;
  }

  void ClearMarks() override {
    for (cudaEvent_t e : marks_) timing_events_.Give(e);
    marks_.clear();
  }

  int64_t AllocatedBytes() override {
#if RP_HAVE_CUDA_LIBTORCH
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index_));
    return stats.allocated_bytes[0].current;  // index 0: all pools together
#else
    return -1;
#endif
  }

  int64_t PeakAllocatedBytes() override {
#if RP_HAVE_CUDA_LIBTORCH
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index_));
    return stats.allocated_bytes[0].peak;
#else
    return -1;
#endif
  }

  std::string MemoryReport() override {
#if RP_HAVE_CUDA_LIBTORCH
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index_));
    char buf[160];
    std::snprintf(buf, sizeof(buf),
                  "device memory peak: %.2f GiB allocated by tensors, %.2f GiB reserved",
                  static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30),
                  static_cast<double>(stats.reserved_bytes[0].peak) / (1 << 30));
    return buf;
#else
    return "";
#endif
  }

  // Copies the probe through the same paths the worker uses: registered segment -> device on a
  // copy stream, device -> a pinned private buffer. Best of three repetitions.
  Status PinReadOnly(const void* base, uint64_t bytes) override {
    // Whole pages: registrations of one page would overlap, and CUDA refuses a second one.
    const auto page = static_cast<uintptr_t>(4096);
    const auto begin = reinterpret_cast<uintptr_t>(base) & ~(page - 1);
    const auto end = (reinterpret_cast<uintptr_t>(base) + bytes + page - 1) & ~(page - 1);
    RP_ASSIGN_OR_RETURN(
        auto reg, HostRegistration::CreateReadOnly(reinterpret_cast<void*>(begin), end - begin));
    read_only_pins_.push_back(std::move(reg));
    return Status::Ok();
  }

  void AdamWComputeCopy(const coord::AdamWHyper& h, float grad_scale, const at::Tensor& grad,
                        const at::Tensor& master, const at::Tensor& m, const at::Tensor& v,
                        const at::Tensor& out) override {
    const int64_t n = out.numel();
    for (const at::Tensor* t : {&grad, &master, &m, &v})
      if (t->numel() != n || t->scalar_type() != at::kFloat || !t->is_contiguous() || !t->is_cuda())
        throw std::runtime_error(
            "AdamWComputeCopy: grad, master and moments must be contiguous fp32 tensors on "
            "the device with the output's " +
            std::to_string(n) + " elements");
    const kernels::Dtype dtype =
        out.scalar_type() == at::kBFloat16 ? kernels::Dtype::kBFloat16 : kernels::Dtype::kFloat32;
    ThrowIfError(
        kernels::AdamWComputeCopy(coord::MakeAdamWConstants(h, grad_scale), grad.data_ptr<float>(),
                                  master.data_ptr<float>(), m.data_ptr<float>(),
                                  v.data_ptr<float>(), out.data_ptr(), dtype, n, kComputeStream),
        "AdamWComputeCopy");
  }

  StatusOr<LinkRates> ProbeLink(const void* src, uint64_t bytes) override {
    void* dev = nullptr;
    void* host = nullptr;
    RP_CUDA_RETURN_IF_ERROR(cudaMalloc(&dev, bytes));
    cudaError_t e = cudaMallocHost(&host, bytes);
    if (e != cudaSuccess) {
      LogIfError(cudaFree(dev), "cudaFree(probe)");
      return CudaStatus(e, "cudaMallocHost(probe)");
    }
    LinkRates r;
    std::vector<CudaEvent> owned;
    Status status = Status::Ok();
    for (int i = 0; i < 3 && status.ok(); ++i) {
      auto made = CudaEvent::Create(cudaEventDefault);
      if (made.ok()) owned.push_back(std::move(made).value());
      else status = made.status();
    }
    cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};
    for (size_t i = 0; i < owned.size(); ++i) ev[i] = owned[i].get();
    for (int rep = 0; rep < 3 && status.ok(); ++rep) {
      cudaEventRecord(ev[0], weights_);
      cudaMemcpyAsync(dev, src, bytes, cudaMemcpyHostToDevice, weights_);
      cudaEventRecord(ev[1], weights_);
      cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, weights_);
      cudaEventRecord(ev[2], weights_);
      status = CudaStatus(cudaEventSynchronize(ev[2]), "cudaEventSynchronize(probe)");
      float h2d_ms = 0.0f, d2h_ms = 0.0f;
      if (status.ok())
        status =
            CudaStatus(cudaEventElapsedTime(&h2d_ms, ev[0], ev[1]), "cudaEventElapsedTime(probe)");
      if (status.ok())
        status =
            CudaStatus(cudaEventElapsedTime(&d2h_ms, ev[1], ev[2]), "cudaEventElapsedTime(probe)");
      if (status.ok() && h2d_ms > 0 && d2h_ms > 0) {
        r.h2d_bytes_per_s = std::max(r.h2d_bytes_per_s, bytes / (h2d_ms * 1e-3));
        r.d2h_bytes_per_s = std::max(r.d2h_bytes_per_s, bytes / (d2h_ms * 1e-3));
      }
    }
    LogIfError(cudaFreeHost(host), "cudaFreeHost(probe)");
    LogIfError(cudaFree(dev), "cudaFree(probe)");
    if (!status.ok()) return status;
    return r;
  }

  bool CommitDone(uint64_t ticket) override {
    std::shared_ptr<Commit> c;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = inflight_.find(ticket);
      if (it == inflight_.end()) return true;
      if (!it->second->done.load(std::memory_order_acquire)) return false;
      c = it->second;
      inflight_.erase(it);
    }
    events_.Give(c->event);
    if (!c->error.empty()) throw std::runtime_error(c->error);
    return true;  // c's tensors are released here, on the compute thread, after the copy ended
  }

 private:
  const char* PoolBytes(int rank, uint64_t offset, uint64_t bytes) const {
    const void* base = nullptr;
    if (rank == own_rank_) {
      base = own_pool_.get();
    } else if (auto it = peers_.find(rank); it != peers_.end()) {
      base = it->second.get();
    }
    if (!base)
      throw std::runtime_error("no activation pool of worker " + std::to_string(rank) +
                               " is open here");
    if (bytes > pool_bytes_ || offset > pool_bytes_ - bytes)
      throw std::runtime_error("activation pool of worker " + std::to_string(rank) + ": " +
                               std::to_string(bytes) + " bytes at offset " +
                               std::to_string(offset) + " do not fit its " +
                               std::to_string(pool_bytes_));
    return static_cast<const char*>(base) + offset;
  }

  struct Fence {
    uint64_t id;
    cudaEvent_t event;
  };
  struct Commit {
    uint64_t ticket = 0;
    std::vector<CommitItem> items;
    cudaEvent_t event = nullptr;
    std::string error;
    std::atomic<bool> done{false};
  };

  void CommitterLoop() {
    cudaSetDevice(index_);
    while (true) {
      std::shared_ptr<Commit> c;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stopping_ || !to_finish_.empty(); });
        if (to_finish_.empty()) return;
        c = to_finish_.front();
        to_finish_.pop_front();
      }
      cudaError_t e = cudaEventSynchronize(c->event);
      if (e != cudaSuccess) c->error = CudaStatus(e, "cudaEventSynchronize(grads)").message();
      c->done.store(true, std::memory_order_release);
    }
  }

  cudaEvent_t TakeEvent() { return events_.Take(); }

  // A store's source stays allocated until its copy is done. A forward stage that writes every
  // block's input to the host (one backward stage per block) would otherwise hold all of them until
  // the microbatch's fence, where the planner counts one block's working set: sources whose copies
  // are done are freed at each store, and older sources beyond kStoreBytesAhead are waited for
  // (copies finish in order on d2h_). Short-sequence stores stay under that bound and never wait,
  // so the host keeps enqueueing ahead of the device.
  static constexpr uint64_t kStoreBytesAhead = 256ull << 20;
  void ReleaseStoredSources() {
    while (pending_stores_.size() > 1) {
      PendingStore& oldest = pending_stores_.front();
      if (!EventDone(oldest.copied, "cudaEventQuery(store)")) {
        if (pending_store_bytes_ - pending_stores_.back().source.nbytes() <= kStoreBytesAhead)
          return;
        ThrowIfError(cudaEventSynchronize(oldest.copied), "cudaEventSynchronize(store)");
      }
      pending_store_bytes_ -= oldest.source.nbytes();
      events_.Give(oldest.copied);
      pending_stores_.pop_front();
    }
  }
  // Forgets the pending stores' events and sources: the caller has waited for d2h_ or holds the
  // sources until a later event on it.
  void DropPendingStores() {
    for (auto& p : pending_stores_) events_.Give(p.copied);
    pending_stores_.clear();
    pending_store_bytes_ = 0;
  }

  static bool EventDone(cudaEvent_t e, const char* what) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaSuccess) return true;
    if (q == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is an answer, not an error LibTorch's next check may see
      return false;
    }
    ThrowIfError(q, what);
    return false;
  }

  void StreamWaitsForCompute(cudaStream_t s) {
    cudaEvent_t e = TakeEvent();
    ThrowIfError(cudaEventRecord(e, kComputeStream), "cudaEventRecord(compute)");
    ThrowIfError(cudaStreamWaitEvent(s, e, 0), "cudaStreamWaitEvent");
    events_.Give(e);  // reusable: a wait captures the event's state when enqueued
  }

  void ComputeWaitsFor(cudaStream_t s) {
    cudaEvent_t e = TakeEvent();
    ThrowIfError(cudaEventRecord(e, s), "cudaEventRecord");
    ThrowIfError(cudaStreamWaitEvent(kComputeStream, e, 0), "cudaStreamWaitEvent(compute)");
    events_.Give(e);
  }

  static void CopyChunked(void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind,
                          cudaStream_t s) {
    for (uint64_t off = 0; off < bytes; off += kChunkBytes)
      ThrowIfError(
          cudaMemcpyAsync(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off,
                          std::min(kChunkBytes, bytes - off), kind, s),
          "cudaMemcpyAsync(weights H2D)");
  }

  int index_;
  HostRegistration registration_;
  std::vector<HostRegistration> read_only_pins_;  // PinReadOnly
  // The owners first: every handle below (and the committer's) is destroyed after its holders.
  CudaStream weights_stream_, acts_stream_, d2h_stream_, grads_stream_;
  EventPool events_{cudaEventDisableTiming};
  EventPool timing_events_{cudaEventDefault};  // profiling marks
  cudaStream_t weights_ = nullptr, acts_ = nullptr, d2h_ = nullptr, grads_ = nullptr;  // theirs
  std::deque<Fence> fences_;
  std::vector<cudaEvent_t> marks_;
  uint64_t fence_counter_ = 0;
  struct PendingStore {
    cudaEvent_t copied = nullptr;  // recorded on d2h_ after the copy
    at::Tensor source;
  };
  std::deque<PendingStore> pending_stores_;  // activation D2H copies since the last fence, in order
  uint64_t pending_store_bytes_ = 0;         // their sources' bytes
  struct Completion {
    uint64_t id = 0;
    cudaEvent_t compute = nullptr, d2h = nullptr;
    std::vector<at::Tensor> keep_alive;  // stores' sources, freed once the copies are done
  };
  std::deque<Completion> completions_;
  uint64_t completion_counter_ = 0;
  struct Squares {
    uint64_t ticket = 0;
    std::vector<SquaresItem> items;                 // the gradients, alive until the sums are read
    at::Tensor sums, host;                          // on the device; pinned copy of them
    std::vector<std::pair<double*, int64_t>> outs;  // each item's destination and chunk count
    cudaEvent_t event = nullptr;
  };
  std::map<uint64_t, std::unique_ptr<Squares>> squares_;
  uint64_t squares_counter_ = 0;
  at::Tensor staging_;  // fp32 chunk of masters being rounded to bf16 (weights stream only)
  uint64_t commit_counter_ = 0;
  DeviceAllocation own_pool_;        // this worker's activation pool (exported)
  std::map<int, IpcMapping> peers_;  // peers' pools, mapped; destroyed before own_pool_
  int own_rank_ = -1;
  uint64_t pool_bytes_ = 0;
  bool pool_copies_pending_ = false;  // a pool store or read since the last Synchronize or fence
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;                                 // GUARDED_BY(mu_)
  std::deque<std::shared_ptr<Commit>> to_finish_;         // GUARDED_BY(mu_)
  std::map<uint64_t, std::shared_ptr<Commit>> inflight_;  // GUARDED_BY(mu_)
  std::thread committer_;  // last member: joined before the state above goes away
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int index, void* base, uint64_t bytes,
                                                 uint64_t memory_limit_bytes) {
  if (!at::hasCUDA())
    return Status::Internal("LibTorch reports no CUDA support (is libtorch_cuda linked?)");
  RP_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  if (memory_limit_bytes > 0) {
    size_t free_bytes = 0, total_bytes = 0;
    RP_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (memory_limit_bytes > total_bytes)
      return Status::InvalidArgument(
          "job.device_memory_limit_gib: " + std::to_string(memory_limit_bytes >> 20) +
          " MiB is more than GPU " + std::to_string(index) + "'s " +
          std::to_string(total_bytes >> 20) + " MiB");
    // The caching allocator is set up by LibTorch's lazy CUDA initialization, which the first
    // tensor on the device runs; a fraction set before it is refused.
    (void)at::empty({1}, at::TensorOptions().dtype(at::kByte).device(
                             at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index))));
    // The allocator refuses (out of memory) past this share of the device, as a smaller card would.
    c10::cuda::CUDACachingAllocator::setMemoryFraction(
        static_cast<double>(memory_limit_bytes) / static_cast<double>(total_bytes),
        static_cast<c10::DeviceIndex>(index));
    RP_LOG(INFO) << "device memory capped at " << (memory_limit_bytes >> 20) << " MiB of "
                 << (total_bytes >> 20) << " MiB (job.device_memory_limit_gib)";
  }
  RP_ASSIGN_OR_RETURN(auto reg, HostRegistration::Create(base, bytes));
  auto dev = std::make_unique<CudaDevice>(index, std::move(reg));
  RP_RETURN_IF_ERROR(dev->Init());
  return std::unique_ptr<Device>(std::move(dev));
}

}  // namespace rp::worker
