// SPDX-License-Identifier: Apache-2.0
// Device: the seam between the worker and the hardware it computes on.
//
// Contract:
//  * Moves bytes between the shared segment and tensors on the device: weight fetch, activation
//    load/store, gradient accumulation into fp32 slots. Everything the executor does to shared
//    memory goes through here, so a backend decides how (plain copies on CPU; pinned DMA on
//    streams for CUDA).
//  * The CPU backend is first-class: it is what CI runs and the oracle the CUDA backend is
//    compared against.
//  * After Synchronize() returns, every store issued before it is visible in shared memory.
//  * One Device per worker process; used by one thread.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "common/status.h"

namespace rp::worker {

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string Describe() const = 0;
  virtual at::Device torch_device() const = 0;
  // A device tensor holding a copy of `src` (shape, dtype).
  virtual at::Tensor Fetch(const void* src, at::IntArrayRef shape, at::ScalarType dtype) = 0;
  // Writes `t` (contiguous after conversion to `dtype`) to `dst`.
  virtual void Store(const at::Tensor& t, void* dst, at::ScalarType dtype) = 0;
  // dst[i] += t[i] in fp32.
  virtual void AccumulateFloat(const at::Tensor& t, float* dst) = 0;
  virtual void Synchronize() = 0;
};

std::unique_ptr<Device> MakeCpuDevice();

}  // namespace rp::worker
