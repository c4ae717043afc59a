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
//    weights never delays the current job's kernels.
//  * Store() and CommitFloat() are asynchronous: their bytes are in shared memory once
//    Synchronize() returns (and not necessarily before).
//  * The CPU backend is first-class: it is what CI runs, and the oracle the CUDA backend is
//    compared with.
//  * One Device per worker process; used by one thread.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace rp::worker {

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string Describe() const = 0;
  virtual at::Device torch_device() const = 0;

  virtual at::Tensor FetchWeights(const void* src, at::IntArrayRef shape, at::ScalarType dtype) = 0;
  virtual uint64_t WeightsFence() = 0;
  virtual void WaitWeights(uint64_t fence) = 0;

  virtual at::Tensor FetchActivation(const void* src, at::IntArrayRef shape, at::ScalarType dtype) = 0;
  // Writes `t` converted to `dtype` to `dst`.
  virtual void Store(const at::Tensor& t, void* dst, at::ScalarType dtype) = 0;
  // Writes fp32 `t` to `dst` (accumulate = false) or adds it there (accumulate = true).
  virtual void CommitFloat(const at::Tensor& t, float* dst, bool accumulate) = 0;
  virtual void Synchronize() = 0;
};

std::unique_ptr<Device> MakeCpuDevice();

// Number of CUDA devices this build can use (0 without CUDA support or without a GPU).
int CudaDeviceCount();
// The CUDA backend for device `index`, with the shared segment [base, base + bytes) pinned for
// DMA. Unavailable in builds without CUDA.
StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int index, void* base, uint64_t bytes);

}  // namespace rp::worker
