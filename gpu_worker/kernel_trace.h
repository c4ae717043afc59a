// SPDX-License-Identifier: Apache-2.0
// KernelTrace: one training step of one worker under LibTorch's Kineto profiler, for diagnosis.
//
// Contract:
//  * Off unless the environment sets RP_TRACE_KERNELS=<path prefix>; then the worker's jobs of
//    step RP_TRACE_KERNELS_STEP (default 3, after allocator and page warm-up) are traced (host-side
//    ATen ops and, on CUDA workers, every kernel and copy with its stream) and written as a Chrome
//    trace to "<prefix>.w<rank>.json" when the worker begins a job of a later step, or when this
//    object is destroyed. bench/kernel_gaps.py summarizes one (idle gaps of the compute stream and
//    what surrounds them).
//  * Tracing slows the traced step; its metrics are not representative.
//  * Failures (no Kineto in this LibTorch, an unwritable path) are logged once and tracing stays
//    off: a diagnosis aid never fails a run. The destructor never throws.
//  * Single-threaded (the worker's loop).
#pragma once

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace rp::worker {

// LibTorch's Kineto profiler for this thread: host-side ATen ops and, where LibTorch has CUDA,
// every kernel and copy. StartKineto() throws where this LibTorch was built without Kineto;
// StopKineto() returns what was recorded (events, and save() as a Chrome trace).
void StartKineto();
std::unique_ptr<torch::autograd::profiler::ProfilerResult> StopKineto();

class KernelTrace {
 public:
  // `drain` waits until the device has run everything enqueued so far (called before the trace
  // is written).
  KernelTrace(int rank, std::function<void()> drain);
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  // The worker is about to begin a job of `step`.
  void OnJobBegin(int64_t step);

 private:
  void Stop();

  std::function<void()> drain_;
  std::string path_;  // empty: off
  int64_t step_ = 3;
  bool active_ = false;
  bool done_ = false;
};

}  // namespace rp::worker
