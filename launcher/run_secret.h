// SPDX-License-Identifier: Apache-2.0
// The secret that seals a multi-node run's store traffic (nodes/store_seal.h), decided once by
// each node's rp-launch and passed to its coordinator and workers in RP_NODE_SECRET.
//
// Contract:
//  * ResolveRunSecret() takes, in this order:
//      1. RP_NODE_SECRET when set: the user's, the same on every node; at least 16 characters.
//      2. Else the file `node-secret` in `output_dir`, keyed with the scheduler's job id when
//         there is one (SLURM_JOB_ID, PBS_JOBID, LSB_JOBID), so each allocation's runs differ.
//         The first node to get there creates it: 32 random bytes as hex, mode 0600, written
//         under a temporary name and linked into place, so a reader sees all of it or none. It
//         is kept for later runs of the directory. This needs `output_dir` on a file system the
//         nodes share; where it is not, each node makes its own and the nodes never meet.
//  * A short RP_NODE_SECRET, or a `node-secret` file that is not 64 hex digits, or not a regular
//    file of this user's with mode 0600 (a link, another user's, readable by others), is an
//    InvalidArgument naming it; a file that cannot be made or read is an IoError naming it.
//  * The environment comes in through `env` (launcher/node_world.h).
#pragma once

#include <string>

#include "common/status.h"
#include "launcher/node_world.h"

namespace rp::launch {

struct RunSecret {
  std::string value;
  std::string source;     // for the log: "RP_NODE_SECRET", or the file and the job id's variable
  bool from_env = false;  // the user's RP_NODE_SECRET: the children inherit it already
};

inline constexpr char kNodeSecretFile[] = "node-secret";

StatusOr<RunSecret> ResolveRunSecret(const std::string& output_dir, const EnvLookup& env);

}  // namespace rp::launch
