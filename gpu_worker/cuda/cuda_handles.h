// SPDX-License-Identifier: Apache-2.0
// Owners of CUDA streams and events: each handle has exactly one owner, which destroys it on
// every path and never throws (a failure to destroy is logged). Compiled only when RP_WITH_CUDA
// is on.
//
// Contract:
//  * CudaStream::Create(priority) makes a non-blocking stream, CudaEvent::Create(flags) one event;
//    the owner destroys it.
//  * EventPool owns every event it ever made. Take() hands out a reusable handle (making one
//    when none is free; throws std::runtime_error if CUDA cannot, like the Device methods that
//    call it); Give() returns it. Handles still out when the pool is destroyed are destroyed
//    with it, so holders must not outlive the pool (the device declares its pools before every
//    container of handles and its committer thread).
//  * Not thread-safe: Take and Give on one thread (the device's caller).
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "gpu_worker/cuda/cuda_check.h"

namespace rp::worker {

class CudaStream {
 public:
  CudaStream() = default;
  static StatusOr<CudaStream> Create(int priority) {
    CudaStream s;
    RP_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithPriority(&s.stream_, cudaStreamNonBlocking, priority));
    return s;
  }
  CudaStream(CudaStream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& o) noexcept {
    if (this != &o) {
      Destroy();
      stream_ = std::exchange(o.stream_, nullptr);
    }
    return *this;
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream() { Destroy(); }
  cudaStream_t get() const { return stream_; }

 private:
  void Destroy() noexcept {
    if (!stream_) return;
    if (const cudaError_t e = cudaStreamDestroy(stream_); e != cudaSuccess)
      RP_LOG(ERROR) << "cudaStreamDestroy: " << cudaGetErrorString(e);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

// One event on its own (a measurement's), destroyed with its owner.
class CudaEvent {
 public:
  static StatusOr<CudaEvent> Create(unsigned flags) {
    CudaEvent e;
    RP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e.event_, flags));
    return e;
  }
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&&) = delete;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() {
    if (event_)
      if (const cudaError_t e = cudaEventDestroy(event_); e != cudaSuccess)
        RP_LOG(ERROR) << "cudaEventDestroy: " << cudaGetErrorString(e);
  }
  cudaEvent_t get() const { return event_; }

 private:
  CudaEvent() = default;
  cudaEvent_t event_ = nullptr;
};

class EventPool {
 public:
  explicit EventPool(unsigned flags) : flags_(flags) {}
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool() {
    for (cudaEvent_t e : owned_)
      if (const cudaError_t err = cudaEventDestroy(e); err != cudaSuccess)
        RP_LOG(ERROR) << "cudaEventDestroy: " << cudaGetErrorString(err);
  }

  cudaEvent_t Take() {
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    if (Status s = CudaStatus(cudaEventCreateWithFlags(&e, flags_), "cudaEventCreateWithFlags");
        !s.ok())
      throw std::runtime_error(s.message());
    owned_.push_back(e);
    return e;
  }
  void Give(cudaEvent_t e) { free_.push_back(e); }

 private:
  unsigned flags_;
  std::vector<cudaEvent_t> owned_;  // every event made, destroyed with the pool
  std::vector<cudaEvent_t> free_;
};

}  // namespace rp::worker
