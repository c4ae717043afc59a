// SPDX-License-Identifier: Apache-2.0
#include "common/session.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace rp {
namespace {
pid_t LauncherPid() {
  const char* v = std::getenv("RP_LAUNCHER_PID");
  return v ? static_cast<pid_t>(std::atol(v)) : 0;
}
}  // namespace

void BindLifetimeToLauncher() {
  pid_t launcher = LauncherPid();
  if (launcher <= 0) return;
  // A SIGKILLed launcher cannot clean up after us; the kernel kills us instead, so no orphan
  // keeps a GPU or a shared-memory mapping alive.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) std::_Exit(10);  // launcher died before prctl took effect
}

bool LauncherGone() {
  pid_t launcher = LauncherPid();
  return launcher > 0 && ::getppid() != launcher;
}
}  // namespace rp
