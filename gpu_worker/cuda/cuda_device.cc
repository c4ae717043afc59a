// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the worker (compiled only when RP_WITH_CUDA is on).
//
// Streams (all non-blocking, so none synchronizes implicitly with LibTorch's compute stream):
//   weights      low priority: H2D of stage weights, in chunks, usually for the *next* job
//   activations  high priority: H2D of the current microbatch's inputs
//   d2h          D2H of outputs, checkpoints and gradients
// Compute runs on LibTorch's current stream of the device (the default stream). Every copy into
// a freshly allocated tensor first waits for the compute stream's progress so far, because the
// caching allocator may hand out memory that queued kernels still read.
#include <cuda_runtime_api.h>

#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "gpu_worker/cuda/cuda_check.h"
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
    RP_CUDA_RETURN_IF_ERROR(cudaHostRegister(base, bytes, cudaHostRegisterPortable));
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

// Pinned staging memory for gradient accumulation (D2H lands here, the CPU adds it into the
// shared slot). Grows, never shrinks; freed on destruction.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (ptr_) LogIfError(cudaFreeHost(ptr_), "cudaFreeHost");
  }
  Status Reserve(uint64_t bytes) {
    if (bytes <= size_) return Status::Ok();
    if (ptr_) RP_CUDA_RETURN_IF_ERROR(cudaFreeHost(ptr_));
    ptr_ = nullptr;
    size_ = 0;
    RP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&ptr_, bytes, cudaHostAllocPortable));
    size_ = bytes;
    return Status::Ok();
  }
  char* data() const { return static_cast<char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  uint64_t size_ = 0;
};

void ThrowIfError(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(CudaStatus(e, call).message());
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int index, HostRegistration reg) : index_(index), registration_(std::move(reg)) {}

  Status Init() {
    int least = 0, greatest = 0;
    RP_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    RP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&weights_, cudaStreamNonBlocking, least));
    RP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&acts_, cudaStreamNonBlocking, greatest));
    RP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&d2h_, cudaStreamNonBlocking, greatest));
    return Status::Ok();
  }

  ~CudaDevice() override {
    LogIfError(cudaDeviceSynchronize(), "cudaDeviceSynchronize at worker exit");
    for (auto& f : fences_) LogIfError(cudaEventDestroy(f.event), "cudaEventDestroy");
    for (cudaEvent_t e : free_events_) LogIfError(cudaEventDestroy(e), "cudaEventDestroy");
    for (cudaStream_t s : {weights_, acts_, d2h_})
      if (s) LogIfError(cudaStreamDestroy(s), "cudaStreamDestroy");
  }

  std::string Describe() const override {
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, index_);
    return "cuda:" + std::to_string(index_) + " (" + p.name + ")";
  }
  at::Device torch_device() const override { return at::Device(at::kCUDA, index_); }

  at::Tensor FetchWeights(const void* src, at::IntArrayRef shape, at::ScalarType dtype) override {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype).device(torch_device()));
    StreamWaitsForCompute(weights_);
    CopyChunked(t.data_ptr(), src, t.nbytes(), cudaMemcpyHostToDevice, weights_);
    return t;
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
      free_events_.push_back(fences_.front().event);
      fences_.pop_front();
    }
  }

  at::Tensor FetchActivation(const void* src, at::IntArrayRef shape, at::ScalarType dtype) override {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype).device(torch_device()));
    StreamWaitsForCompute(acts_);
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
    keep_alive_.push_back(src);
  }

  void CommitFloat(const at::Tensor& t, float* dst, bool accumulate) override {
    at::Tensor src = t.detach().to(at::kFloat).contiguous();
    if (!accumulate) {
      Store(src, dst, at::kFloat);
      return;
    }
    pending_adds_.push_back({src, dst, staged_bytes_});
    staged_bytes_ += (src.nbytes() + 255) / 256 * 256;
  }

  void Synchronize() override {
    if (!pending_adds_.empty()) {
      // Accumulating commits: stage them all in pinned memory, then add on the CPU in parallel.
      Status s = staging_.Reserve(staged_bytes_);
      if (!s.ok()) throw std::runtime_error(s.message());
      StreamWaitsForCompute(d2h_);
      for (auto& a : pending_adds_)
        ThrowIfError(cudaMemcpyAsync(staging_.data() + a.offset, a.src.data_ptr(), a.src.nbytes(),
                                     cudaMemcpyDeviceToHost, d2h_),
                     "cudaMemcpyAsync(gradient D2H)");
    }
    ThrowIfError(cudaStreamSynchronize(d2h_), "cudaStreamSynchronize(d2h)");
    if (!pending_adds_.empty()) AddStaged();
    pending_adds_.clear();
    staged_bytes_ = 0;
    keep_alive_.clear();
  }

 private:
  struct Fence {
    uint64_t id;
    cudaEvent_t event;
  };
  struct PendingAdd {
    at::Tensor src;
    float* dst;
    uint64_t offset;
  };

  cudaEvent_t TakeEvent() {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e;
    ThrowIfError(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    return e;
  }

  void StreamWaitsForCompute(cudaStream_t s) {
    cudaEvent_t e = TakeEvent();
    ThrowIfError(cudaEventRecord(e, kComputeStream), "cudaEventRecord(compute)");
    ThrowIfError(cudaStreamWaitEvent(s, e, 0), "cudaStreamWaitEvent");
    free_events_.push_back(e);  // reusable: a wait captures the event's state when enqueued
  }

  void ComputeWaitsFor(cudaStream_t s) {
    cudaEvent_t e = TakeEvent();
    ThrowIfError(cudaEventRecord(e, s), "cudaEventRecord");
    ThrowIfError(cudaStreamWaitEvent(kComputeStream, e, 0), "cudaStreamWaitEvent(compute)");
    free_events_.push_back(e);
  }

  static void CopyChunked(void* dst, const void* src, uint64_t bytes, cudaMemcpyKind kind,
                          cudaStream_t s) {
    for (uint64_t off = 0; off < bytes; off += kChunkBytes)
      ThrowIfError(cudaMemcpyAsync(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off,
                                   std::min(kChunkBytes, bytes - off), kind, s),
                   "cudaMemcpyAsync(weights H2D)");
  }

  void AddStaged() {
    uint64_t total = 0;
    for (auto& a : pending_adds_) total += a.src.numel();
    const int threads = static_cast<int>(std::min<uint64_t>(8, 1 + total / (1 << 20)));
    auto work = [&](int t) {
      for (auto& a : pending_adds_) {
        const int64_t n = a.src.numel();
        const int64_t b = n * t / threads, e = n * (t + 1) / threads;
        const float* s = reinterpret_cast<const float*>(staging_.data() + a.offset);
        for (int64_t i = b; i < e; ++i) a.dst[i] += s[i];
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
    work(0);
    for (auto& th : pool) th.join();
  }

  int index_;
  HostRegistration registration_;
  cudaStream_t weights_ = nullptr, acts_ = nullptr, d2h_ = nullptr;
  std::deque<Fence> fences_;
  std::vector<cudaEvent_t> free_events_;
  uint64_t fence_counter_ = 0;
  std::vector<at::Tensor> keep_alive_;  // sources of in-flight D2H copies
  std::vector<PendingAdd> pending_adds_;
  uint64_t staged_bytes_ = 0;
  PinnedBuffer staging_;
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

StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int index, void* base, uint64_t bytes) {
  if (!at::hasCUDA())
    return Status::Internal("LibTorch reports no CUDA support (is libtorch_cuda linked?)");
  RP_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  RP_ASSIGN_OR_RETURN(auto reg, HostRegistration::Create(base, bytes));
  auto dev = std::make_unique<CudaDevice>(index, std::move(reg));
  RP_RETURN_IF_ERROR(dev->Init());
  return std::unique_ptr<Device>(std::move(dev));
}

}  // namespace rp::worker
