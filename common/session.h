// SPDX-License-Identifier: Apache-2.0
// Names shared by the launcher, coordinator and workers of one run.
#pragma once

#include <string>

namespace rp {
// The coordinator's control socket inside the private runtime directory. It appears when the
// coordinator binds it, which is once the run's shared state is filled.
inline std::string ControlSocketPath(const std::string& runtime_dir) { return runtime_dir + "/control.sock"; }
// ipc:// endpoint of that socket.
inline std::string ControlEndpoint(const std::string& runtime_dir) { return "ipc://" + ControlSocketPath(runtime_dir); }
// If this process was started by rp-launch (RP_LAUNCHER_PID set), arranges to be killed when the
// launcher dies and exits at once if it is already gone. Call first thing in main().
void BindLifetimeToLauncher();
// True if the launcher that started us is gone (always false when not started by rp-launch).
bool LauncherGone();
// True if this process was started by rp-launch (RP_LAUNCHER_PID set).
bool StartedByLauncher();
}  // namespace rp
