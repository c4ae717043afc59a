// SPDX-License-Identifier: Apache-2.0
// The grant that reads mode keys (ModeKey in config/job_config.h). Included only where a key's
// value is the subject: the job file's reader and writers, its checks, ResolveExecution, and
// the spellings a run spec or a checkpoint records. Tools.ModeKeysAreReadInTheResolutionOnly
// keeps that list; everything else asks the ExecutionPlan (config/execution_plan.h).
#pragma once

#include "config/job_config.h"

namespace rp::core {

struct ModeKeyGrant {
  static ModeKeyAccess Access() { return ModeKeyAccess(); }
};

}  // namespace rp::core
