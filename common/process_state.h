// SPDX-License-Identifier: Apache-2.0
// What the kernel says a process of this host is doing, for liveness verdicts: a process stopped
// by a signal (SIGSTOP, SIGTSTP from Ctrl-Z) or held by a debugger is not hung; it is waiting for
// someone to let it go.
#pragma once

#include <sys/types.h>

namespace rp {

// True when process `pid` is in the stopped ('T') or traced-stop ('t') state (field 3 of
// /proc/PID/stat). False for a running, sleeping or unknown process, or one that is gone.
bool ProcessStopped(pid_t pid);

}  // namespace rp
