// SPDX-License-Identifier: Apache-2.0
// Names shared by the launcher, coordinator and workers of one run.
#pragma once

#include <string>
#include <vector>

namespace rp {
// Files of the private runtime directory besides the control socket: the launcher's claim on the
// run's names, the run spec the coordinator and workers read, the coordinator's progress beacon.
inline constexpr char kOwnerFile[] = "owner";
inline constexpr char kRunSpecFile[] = "run-spec.json";
inline constexpr char kBeaconFile[] = "coordinator.alive";
// Every name a run may make in its runtime directory (these, the control socket, the stop
// agreement's files and the temporary names they are written under).
std::vector<std::string> RuntimeFileNames();
// The coordinator's control socket inside the private runtime directory. It appears when the
// coordinator binds it, which is once the run's shared state is filled.
inline std::string ControlSocketPath(const std::string& runtime_dir) {
  return runtime_dir + "/control.sock";
}
// ipc:// endpoint of that socket.
inline std::string ControlEndpoint(const std::string& runtime_dir) {
  return "ipc://" + ControlSocketPath(runtime_dir);
}
// If this process was started by rp-launch (RP_LAUNCHER_PID set), arranges to get `death_signal`
// when the launcher dies (SIGKILL: to die with it) and exits at once if it is already gone. Call
// first thing in main().
void BindLifetimeToLauncher(int death_signal = 9 /* SIGKILL */);
// For the process that outlives a SIGKILLed launcher long enough to clean up (the coordinator
// binds its lifetime with SIGHUP): on SIGHUP from a launcher that is gone, unlinks each of
// `paths` (the run's shared-memory names and the files of its runtime directory), removes the
// then empty directory `dir` and exits with kExitPeerLost, so nothing named outlives the run.
// The handler makes only async-signal-safe calls on copies made now. A SIGHUP while the launcher
// lives (someone else's) is ignored.
void RemoveOnLauncherDeath(const std::vector<std::string>& paths, const std::string& dir);
// True if the launcher that started us is gone (always false when not started by rp-launch).
bool LauncherGone();
// True if this process was started by rp-launch (RP_LAUNCHER_PID set).
bool StartedByLauncher();
}  // namespace rp
