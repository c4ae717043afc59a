// SPDX-License-Identifier: Apache-2.0
#include "launcher/child_process.h"

#include "common/environment.h"

#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

namespace rp::launch {

std::string ExitInfo::Describe() const {
  if (!signaled) return "exited with code " + std::to_string(code);
  const char* name = sigabbrev_np(code);
  return "was killed by signal " + std::to_string(code) +
         (name ? std::string(" (SIG") + name + ")" : "");
}

StatusOr<ChildProcess> ChildProcess::Spawn(const std::string& role,
                                           const std::vector<std::string>& argv,
                                           const std::vector<std::string>& extra_env,
                                           int output_fd) {
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_store = EnvironmentEntries();
  for (auto& e : extra_env) env_store.push_back(e);
  std::vector<char*> env;
  for (auto& e : env_store) env.push_back(const_cast<char*>(e.c_str()));
  env.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (output_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, output_fd, 1);
    posix_spawn_file_actions_adddup2(&actions, output_fd, 2);
  }
  // The launcher blocks SIGINT, SIGTERM and SIGCHLD to take them synchronously; a child must not
  // inherit that mask (it would never see the launcher's SIGTERM or a graceful SIGINT).
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) sigaddset(&defaults, sig);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  // posix_spawnp: a --worker-wrapper names its tool without a path.
  int rc = ::posix_spawnp(&pid, argv[0].c_str(), &actions, &attr, args.data(), env.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return Status::FromErrno("starting " + role + " (" + argv[0] + ")", rc);
  return ChildProcess(role, pid);
}

ChildProcess::ChildProcess(ChildProcess&& o) noexcept
    : role_(std::move(o.role_)), pid_(o.pid_), exit_(o.exit_) {
  o.pid_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    Terminate(std::chrono::milliseconds(2000));
    role_ = std::move(o.role_);
    pid_ = o.pid_;
    exit_ = o.exit_;
    o.pid_ = -1;
  }
  return *this;
}

ChildProcess::~ChildProcess() { Terminate(std::chrono::milliseconds(2000)); }

bool ChildProcess::TryReap() {
  if (pid_ <= 0) return true;
  if (exit_) return true;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r != pid_) return false;
  ExitInfo info;
  if (WIFSIGNALED(status)) {
    info.signaled = true;
    info.code = WTERMSIG(status);
  } else {
    info.code = WEXITSTATUS(status);
  }
  exit_ = info;
  return true;
}

void ChildProcess::Signal(int sig) const {
  if (pid_ > 0 && !exit_) ::kill(pid_, sig);
}

void ChildProcess::Terminate(std::chrono::milliseconds grace) {
  if (pid_ <= 0 || TryReap()) return;
  ::kill(pid_, SIGTERM);
  auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (TryReap()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  exit_ = ExitInfo{true, SIGKILL};
}

}  // namespace rp::launch
