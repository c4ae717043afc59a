// SPDX-License-Identifier: Apache-2.0
// The worker's one exception boundary. LibTorch and the Device seam report failures by throwing
// (c10::Error, std::runtime_error from a CUDA call); every call into them from the executor and
// the worker's loop runs inside Guarded(), which turns an exception into Internal naming what was
// being done. Nothing else in gpu_worker/ catches, so no exception crosses a Status API.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <utility>

#include "common/status.h"

namespace rp::worker {

// `body` returns Status; `context` (called only on failure) returns what was being done.
template <typename Context, typename Body>
Status Guarded(Context&& context, Body&& body) {
  try {
    return std::forward<Body>(body)();
  } catch (const c10::OutOfMemoryError& e) {
    // The plan's working set is larger than the device (or job.device_memory_limit_gib): say
    // what decides it, beside LibTorch's own account.
    return Status::Internal(
        std::forward<Context>(context)() + ": " + e.what_without_backtrace() +
        " [the plan does not fit this device: rp-plan prints its estimated peak per worker "
        "and where it goes; with schedule.partition = \"auto\" set schedule.gpu_memory_gb "
        "(or job.device_memory_limit_gib) below the device's memory, or lower "
        "train.microbatch_size or data.seq_len]");
  } catch (const c10::Error& e) {
    return Status::Internal(std::forward<Context>(context)() + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::Internal(std::forward<Context>(context)() + ": " + e.what());
  }
}

}  // namespace rp::worker
