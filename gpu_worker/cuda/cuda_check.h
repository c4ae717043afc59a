// SPDX-License-Identifier: Apache-2.0
// Checked CUDA runtime calls: failures become Status values naming the call and the CUDA error.
// Compiled only when RP_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/status.h"

namespace rp::worker {

inline Status CudaStatus(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  return Status::Internal(std::string(call) + ": " + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ")");
}

}  // namespace rp::worker

#define RP_CUDA_RETURN_IF_ERROR(call) RP_RETURN_IF_ERROR(::rp::worker::CudaStatus((call), #call))
