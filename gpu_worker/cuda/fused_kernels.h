// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's model::FusedKernels (stateless; one instance per process).
#pragma once

#include "model/fused_kernels.h"

namespace rp::worker {

const model::FusedKernels& CudaKernels();

}  // namespace rp::worker
