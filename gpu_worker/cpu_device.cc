// SPDX-License-Identifier: Apache-2.0
// CPU backend: host copies stand in for DMA, so the worker runs the same code path as on a GPU.
#include "gpu_worker/device.h"

namespace rp::worker {
namespace {

class CpuDevice final : public Device {
 public:
  std::string Describe() const override { return "cpu"; }
  at::Device torch_device() const override { return at::Device(at::kCPU); }

  at::Tensor Fetch(const void* src, at::IntArrayRef shape, at::ScalarType dtype) override {
    // A copy, not a view: the weights a job computes with must not change under it if the
    // optimizer rewrites the compute copy while the job is still running.
    return at::from_blob(const_cast<void*>(src), shape, at::TensorOptions().dtype(dtype)).clone();
  }

  void Store(const at::Tensor& t, void* dst, at::ScalarType dtype) override {
    at::Tensor out = at::from_blob(dst, t.sizes(), at::TensorOptions().dtype(dtype));
    out.copy_(t.detach());
  }

  void AccumulateFloat(const at::Tensor& t, float* dst) override {
    at::Tensor out = at::from_blob(dst, t.sizes(), at::TensorOptions().dtype(at::kFloat));
    out.add_(t.detach().to(at::kFloat));
  }

  void Synchronize() override {}
};

}  // namespace

std::unique_ptr<Device> MakeCpuDevice() { return std::make_unique<CpuDevice>(); }

}  // namespace rp::worker
