// SPDX-License-Identifier: Apache-2.0
// Which node of a multi-node run this rp-launch is, and where the run's rendezvous store is.
//
// Contract:
//  * ResolveNodeWorld() decides it once, from the first of these that is present:
//      1. rp-launch --nnodes N --node-rank R --master ADDR:PORT (all three when N > 1);
//      2. torchrun's environment (torchrun --nproc-per-node 1 --no-python rp-launch ...): RANK,
//         WORLD_SIZE, MASTER_ADDR, MASTER_PORT. torchrun's own store listens on MASTER_PORT, so
//         the run's store takes RP_MASTER_PORT, else MASTER_PORT + 1;
//      3. Slurm's environment (srun --ntasks-per-node 1 rp-launch ...): SLURM_PROCID,
//         SLURM_NTASKS (SLURM_NTASKS_PER_NODE must be 1), the first host of SLURM_STEP_NODELIST
//         or SLURM_JOB_NODELIST (MASTER_ADDR if set), MASTER_PORT (else 29500);
//      4. none of them: one node.
//  * A value that is missing, not a number or out of range is an InvalidArgument naming the flag
//    or the variable. Pure: the environment comes in through `env`.
//  * ExpandHostList() expands a Slurm host list ("node[01-03,7],gpu5", "rack[1-2]-n[1-2]") in
//    Slurm's order, keeping each range bound's zero padding.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace rp::launch {

struct NodeFlags {
  int nnodes = 0;      // 0 = not given
  int node_rank = -1;  // -1 = not given
  std::string master;  // "ADDR:PORT" ("[v6addr]:PORT"); empty = not given
};

struct NodeWorld {
  int nodes = 1;
  int rank = 0;
  std::string store_host;  // empty for one node
  int store_port = 0;
  std::string source = "single";  // "flags", "torchrun", "slurm" or "single": where it came from
};

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
// The process environment, for ResolveNodeWorld.
std::optional<std::string> ProcessEnv(const std::string& name);

StatusOr<NodeWorld> ResolveNodeWorld(const NodeFlags& flags, const EnvLookup& env);
StatusOr<std::vector<std::string>> ExpandHostList(const std::string& list);

}  // namespace rp::launch
