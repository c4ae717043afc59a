// SPDX-License-Identifier: Apache-2.0
#include "common/session.h"
#include "common/environment.h"

#include "common/exit_codes.h"
#include "common/stop_agreement.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace rp {
namespace {

// What RemoveOnLauncherDeath's handler removes: built before the handler is installed and never
// changed afterwards, so the handler only reads it.
const std::vector<std::string>* g_death_paths = nullptr;
const std::string* g_death_dir = nullptr;
pid_t g_death_launcher = 0;

void OnLauncherDeath(int) {
  // The kernel sends the death signal once this process has been given to another parent; a
  // zombie launcher not yet reaped would still answer kill(pid, 0).
  if (::getppid() == g_death_launcher) return;  // the launcher lives: someone else's SIGHUP
  for (const auto& p : *g_death_paths) ::unlink(p.c_str());
  ::rmdir(g_death_dir->c_str());
  ::_exit(kExitPeerLost);
}
pid_t LauncherPid() {
  const auto v = EnvironmentValue("RP_LAUNCHER_PID");
  return v ? static_cast<pid_t>(std::atol(v->c_str())) : 0;
}
}  // namespace

void BindLifetimeToLauncher(int death_signal) {
  pid_t launcher = LauncherPid();
  if (launcher <= 0) return;
  // A SIGKILLed launcher cannot clean up after us; the kernel signals us instead, so no orphan
  // keeps a GPU or a shared-memory mapping alive.
  ::prctl(PR_SET_PDEATHSIG, death_signal);
  // Under a --worker-wrapper our parent is the wrapper, not the launcher; only a launcher that
  // is gone already means we should not start.
  if (::getppid() != launcher && ::kill(launcher, 0) != 0) std::_Exit(10);
}

void RemoveOnLauncherDeath(const std::vector<std::string>& paths, const std::string& dir) {
  if (g_death_paths != nullptr) return;  // once per process
  g_death_paths = new std::vector<std::string>(paths);
  g_death_dir = new std::string(dir);
  g_death_launcher = LauncherPid();
  if (g_death_launcher <= 0) return;
  struct sigaction sa {};
  sa.sa_handler = OnLauncherDeath;
  ::sigaction(SIGHUP, &sa, nullptr);
  // The launcher may have died before the handler was in place.
  OnLauncherDeath(SIGHUP);
}

std::vector<std::string> RuntimeFileNames() {
  std::vector<std::string> names = {kOwnerFile, std::string(kOwnerFile) + ".tmp", "control.sock",
                                    kRunSpecFile, kBeaconFile};
  for (const char* f : {kStopProposalFile, kStopAgreedFile}) {
    names.push_back(f);
    names.push_back(std::string(f) + ".tmp");
  }
  return names;
}

bool StartedByLauncher() { return LauncherPid() > 0; }

bool LauncherGone() {
  pid_t launcher = LauncherPid();
  return launcher > 0 && ::getppid() != launcher && ::kill(launcher, 0) != 0;
}
}  // namespace rp
