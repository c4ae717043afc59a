// SPDX-License-Identifier: Apache-2.0
// Maps a final Status to the process exit code (common/exit_codes.h).
#pragma once

#include "common/exit_codes.h"
#include "common/status.h"

namespace rp {
inline int ExitCodeFor(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk: return kExitOk;
    case StatusCode::kInvalidArgument: return kExitBadConfig;
    case StatusCode::kCancelled: return kExitInterrupted;
    case StatusCode::kUnavailable: return kExitPeerLost;
    case StatusCode::kProtocolError: return kExitProtocolError;
    case StatusCode::kNonFinite: return kExitDiverged;
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists:
    case StatusCode::kIoError:
    case StatusCode::kDeadlineExceeded:
    case StatusCode::kInternal: return kExitError;
  }
  return kExitError;
}
}  // namespace rp
