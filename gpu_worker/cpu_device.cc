// SPDX-License-Identifier: Apache-2.0
// CPU backend: host copies stand in for DMA, so the worker runs the same code path as on a GPU.
#include "rp_config.h"
#include "gpu_worker/device.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace rp::worker {
namespace {

at::Tensor View(const void* p, at::IntArrayRef shape, at::ScalarType dtype) {
  return at::from_blob(const_cast<void*>(p), shape, at::TensorOptions().dtype(dtype));
}

class CpuDevice final : public Device {
 public:
  std::string Describe() const override { return "cpu"; }
  at::Device torch_device() const override { return at::Device(at::kCPU); }

  // Copies, not views: a job's weights must not change under it if the optimizer rewrites the
  // compute copy, and a consumer's input must not change if its slot is refilled.
  at::Tensor FetchWeights(const void* src, at::IntArrayRef shape, at::ScalarType stored,
                          at::ScalarType dtype) override {
    if (stored == dtype) return View(src, shape, dtype).clone();
    return View(src, shape, stored).to(dtype);  // a new tensor: the conversion copies
  }
  uint64_t WeightsFence() override { return 0; }
  void WaitWeights(uint64_t) override {}
  at::Tensor FetchActivation(const void* src, at::IntArrayRef shape, at::ScalarType dtype) override {
    return View(src, shape, dtype).clone();
  }
  void Store(const at::Tensor& t, void* dst, at::ScalarType dtype) override {
    View(dst, t.sizes(), dtype).copy_(t.detach());
  }
  void Synchronize() override {}
  uint64_t StartCommit(std::vector<CommitItem> items, bool accumulate) override {
    for (auto& it : items) {
      at::Tensor out = View(it.dst, it.grad.sizes(), at::kFloat);
      if (accumulate) out.add_(it.grad.detach());
      else out.copy_(it.grad.detach());
    }
    return ++tickets_;
  }
  bool CommitDone(uint64_t) override { return true; }

  int Mark() override {
    marks_.push_back(std::chrono::steady_clock::now());
    return static_cast<int>(marks_.size()) - 1;
  }
  double MarkSeconds(int a, int b) override {
    return std::chrono::duration<double>(marks_.at(b) - marks_.at(a)).count();
  }
  void ClearMarks() override { marks_.clear(); }

  // A CPU worker's "transfers" are the copies FetchWeights/FetchActivation/Store make.
  StatusOr<LinkRates> ProbeLink(const void* src, uint64_t bytes) override {
    std::vector<char> a(bytes), b(bytes);
    LinkRates r;
    for (int rep = 0; rep < 3; ++rep) {  // the best of three: the first touches fresh pages
      auto t0 = std::chrono::steady_clock::now();
      std::memcpy(a.data(), src, bytes);
      auto t1 = std::chrono::steady_clock::now();
      std::memcpy(b.data(), a.data(), bytes);
      auto t2 = std::chrono::steady_clock::now();
      r.h2d_bytes_per_s = std::max(r.h2d_bytes_per_s, bytes / std::chrono::duration<double>(t1 - t0).count());
      r.d2h_bytes_per_s = std::max(r.d2h_bytes_per_s, bytes / std::chrono::duration<double>(t2 - t1).count());
    }
    return r;
  }

 private:
  uint64_t tickets_ = 0;
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

}  // namespace

std::unique_ptr<Device> MakeCpuDevice() { return std::make_unique<CpuDevice>(); }

#if !RP_WITH_CUDA
int CudaDeviceCount() { return 0; }
StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int, void*, uint64_t) {
  return Status::InvalidArgument("job.device: \"cuda\" requested, but this build has no CUDA "
                                 "backend (configure against a CUDA LibTorch with the CUDA toolkit)");
}
#endif

}  // namespace rp::worker
