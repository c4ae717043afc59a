// SPDX-License-Identifier: Apache-2.0
// The files through which a node's coordinator and its rp-launch agree with the other nodes on the
// step after which an interrupted multi-node run stops.
//
// Why: the nodes' workers sum every gradient job across the nodes and, with sharded state, a
// checkpoint is complete only with every node's part, so every node must stop after the same
// step. The coordinator has no link to the other nodes; its launcher has the node store.
//
// Protocol (several nodes only): on an interrupt the coordinator writes the step it can stop after
// without abandoning a dispatched step into <runtime dir>/kStopProposalFile and dispatches no later
// step; its launcher posts it to the node store, and once every node has, writes the largest into
// <runtime dir>/kStopAgreedFile, which the coordinator reads and runs up to, then checkpoints.
//
// Contract: WriteStepFile is atomic (a temporary name, then rename): a reader sees no file or the
// whole number. ReadStepFile returns nullopt while the file does not exist, and an error naming
// the file when its content is not one non-negative step count.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

namespace rp {

inline constexpr char kStopProposalFile[] = "stop-proposal";
inline constexpr char kStopAgreedFile[] = "stop-agreed";

Status WriteStepFile(const std::string& path, int64_t step);
StatusOr<std::optional<int64_t>> ReadStepFile(const std::string& path);

}  // namespace rp
