// SPDX-License-Identifier: Apache-2.0
// Names shared by the launcher, coordinator and workers of one run.
#pragma once

#include <string>

namespace rp {
// ipc:// endpoint of the coordinator's control socket inside the private runtime directory.
inline std::string ControlEndpoint(const std::string& runtime_dir) {
  return "ipc://" + runtime_dir + "/control.sock";
}
// If this process was started by rp-launch (RP_LAUNCHER_PID set), arranges to be killed when the
// launcher dies and exits at once if it is already gone. Call first thing in main().
void BindLifetimeToLauncher();
// True if the launcher that started us is gone (always false when not started by rp-launch).
bool LauncherGone();
}  // namespace rp
