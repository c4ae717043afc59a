// SPDX-License-Identifier: Apache-2.0
// Process exit codes shared by rp-launch, rp-coordinator, rp-worker and the tests that assert on
// them. Values are part of the command-line interface: never renumber.
#pragma once

namespace rp {
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;        // unexpected failure; the log names it
inline constexpr int kExitBadConfig = 2;    // bad job file, flag or --set override
inline constexpr int kExitInterrupted = 3;  // stopped by SIGINT/SIGTERM
inline constexpr int kExitReplan = 4;       // coordinator: checkpointed to restart on a new plan
inline constexpr int kExitDiverged = 5;     // a step's loss or gradient norm was not finite
inline constexpr int kExitPeerLost = 10;    // a worker or the coordinator died
inline constexpr int kExitCudaError = 11;
inline constexpr int kExitProtocolError = 12;
}  // namespace rp
