// SPDX-License-Identifier: Apache-2.0
// The memory of the host's GPUs as the driver reports it (nvidia-smi), for the planner's budget of
// a job that leaves it to the host (config/job_config.h, HostFacts). The launcher asks the driver
// rather than CUDA: it never initializes CUDA itself.
//
// Contract:
//  * SmallestGpuMemoryGib() reads nvidia-smi's `--query-gpu=memory.total --format=csv,noheader,
//    nounits` output (MiB, one line per GPU in index order) and returns the smallest among the
//    GPUs CUDA_VISIBLE_DEVICES (`visible`) names by index; all of them when it is unset or names
//    GPUs by UUID or MIG instance. In GiB; 0 when no line parses. Pure.
//  * QueryGpuMemoryGib() runs nvidia-smi when it is on PATH (for at most 10 s) and parses its
//    output; 0 when it is missing, fails or takes longer (the job then plans without a budget).
#pragma once

#include <optional>
#include <string>

#include "launcher/node_world.h"

namespace rp::launch {

double SmallestGpuMemoryGib(const std::string& nvidia_smi_csv,
                            const std::optional<std::string>& visible);
double QueryGpuMemoryGib(const EnvLookup& env);

}  // namespace rp::launch
