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
  // Under a --worker-wrapper our parent is the wrapper, not the launcher; only a launcher that
  // is gone already means we should not start.
  if (::getppid() != launcher && ::kill(launcher, 0) != 0) std::_Exit(10);
}

bool StartedByLauncher() { return LauncherPid() > 0; }

bool LauncherGone() {
  pid_t launcher = LauncherPid();
  return launcher > 0 && ::getppid() != launcher && ::kill(launcher, 0) != 0;
}
}  // namespace rp
