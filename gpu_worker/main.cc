// SPDX-License-Identifier: Apache-2.0
// rp-worker: normally started by rp-launch, which passes every flag below.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include <CLI/CLI.hpp>
#include <torch/version.h>

#include "common/exit_status.h"
#include "common/environment.h"
#include "common/logging.h"
#include "common/session.h"
#include "common/test_hooks.h"
#include "gpu_worker/worker.h"

namespace {
void OnSignal(int) { rp::worker::RequestStop(); }

volatile sig_atomic_t g_debug_resume = 0;
void OnDebugResume(int) { g_debug_resume = 1; }

// True when a tracer (gdb, cuda-gdb) is attached: /proc/self/status says TracerPid != 0.
bool DebuggerAttached() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("TracerPid:", 0) == 0) return std::atoi(line.c_str() + 10) != 0;
  return false;
}
}  // namespace

int main(int argc, char** argv) {
  rp::BindLifetimeToLauncher();
#if TORCH_VERSION_MAJOR >= 2
  // Stage jobs allocate weights of different sizes job after job; with fixed-size segments the
  // caching allocator's reserve grows far past what is allocated (21 GiB reserved for a 4B plan
  // that allocates 15 GiB). Growable segments keep the reserve near the allocation. Set before
  // the first CUDA allocation; a user's own setting wins.
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", /*overwrite=*/0);
#endif
  rp::worker::WorkerOptions o;
  int verbosity = 0;
  CLI::App app{"RoundPipe worker (started by rp-launch)"};
  app.add_option("--rank", o.rank, "worker rank")->required()->check(CLI::Range(0, 4095));
  app.add_option("--spec", o.spec_path, "the run spec rp-launch wrote (run-spec.json)")->required();
  app.add_option("--gpus", o.num_workers, "number of workers")->required();
  app.add_option("--session", o.session, "session id")->required();
  app.add_option("--runtime-dir", o.runtime_dir, "private runtime directory")->required();
  app.add_option("--hello-timeout-s", o.welcome_timeout_s,
                 "how long to wait for the coordinator's Welcome once it listens");
  app.add_option("-v", verbosity, "verbosity");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : rp::kExitBadConfig;
  }
  rp::InitLogging(argv[0], "worker " + std::to_string(o.rank));
  if (const int t = rp::TestWelcomeTimeoutSeconds(); t >= 0) o.welcome_timeout_s = t;
  if (rp::EnvironmentValue("RP_DEBUG_PAUSE")) {
    // --debug-worker: let any debugger of this user attach (Yama ptrace scope) and wait, before
    // touching the GPU, until one is attached and lets the process run, or until SIGUSR1. Not a
    // SIGSTOP: a stopped process stays stopped after a debugger detaches, which confuses users.
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    struct sigaction resume {};
    resume.sa_handler = OnDebugResume;
    sigaction(SIGUSR1, &resume, nullptr);
    RP_LOG(WARNING) << "paused for a debugger (pid " << getpid() << ")";
    while (!g_debug_resume && !DebuggerAttached()) usleep(100 * 1000);
    RP_LOG(WARNING) << (g_debug_resume ? "resumed by SIGUSR1" : "debugger attached; running");
  }
  rp::SetVerbosity(verbosity);
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGTERM, &sa, nullptr);
  // Ctrl-C reaches the whole process group; stopping is the launcher's and the coordinator's call
  // (a graceful stop needs the workers to finish the step), so workers leave on Shutdown or
  // SIGTERM.
  signal(SIGINT, SIG_IGN);
  rp::Status s = rp::worker::RunWorker(o);
  if (!s.ok()) {
    RP_LOG(ERROR) << s.ToString();
    return rp::ExitCodeFor(s);
  }
  return 0;
}
