// SPDX-License-Identifier: Apache-2.0
// rp-worker: normally started by rp-launch, which passes every flag below.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>

#include <CLI/CLI.hpp>

#include "common/exit_status.h"
#include "common/logging.h"
#include "common/session.h"
#include "gpu_worker/worker.h"

namespace {
void OnSignal(int) { rp::worker::RequestStop(); }
}  // namespace

int main(int argc, char** argv) {
  rp::BindLifetimeToLauncher();
  rp::worker::WorkerOptions o;
  int verbosity = 0;
  CLI::App app{"RoundPipe worker (started by rp-launch)"};
  app.add_option("--rank", o.rank, "worker rank")->required()->check(CLI::Range(0, 4095));
  app.add_option("--job", o.job_path, "job file")->required();
  app.add_option("--set", o.overrides, "section.key=value override");
  app.add_option("--gpus", o.num_workers, "number of workers")->required();
  app.add_option("--session", o.session, "session id")->required();
  app.add_option("--runtime-dir", o.runtime_dir, "private runtime directory")->required();
  app.add_option("--hello-timeout-s", o.welcome_timeout_s, "how long to wait for the coordinator's Welcome");
  app.add_option("-v", verbosity, "verbosity");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : rp::kExitBadConfig;
  }
  rp::InitLogging(argv[0], "worker " + std::to_string(o.rank));
  if (std::getenv("RP_DEBUG_PAUSE") != nullptr) {
    // --debug-worker: let any debugger of this user attach (Yama ptrace scope), then wait stopped
    // until it (or kill -CONT) resumes us; nothing has touched the GPU yet.
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    RP_LOG(WARNING) << "paused for a debugger (pid " << getpid() << ")";
    raise(SIGSTOP);
  }
  rp::SetVerbosity(verbosity);
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGTERM, &sa, nullptr);
  // Ctrl-C reaches the whole process group; stopping is the launcher's and the coordinator's call
  // (a graceful stop needs the workers to finish the step), so workers leave on Shutdown or SIGTERM.
  signal(SIGINT, SIG_IGN);
  rp::Status s = rp::worker::RunWorker(o);
  if (!s.ok()) {
    RP_LOG(ERROR) << s.ToString();
    return rp::ExitCodeFor(s);
  }
  return 0;
}
