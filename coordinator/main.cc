// SPDX-License-Identifier: Apache-2.0
// rp-coordinator: normally started by rp-launch, which passes every flag below.
#include <signal.h>

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/exit_status.h"
#include "common/logging.h"
#include "common/session.h"
#include "coordinator/coordinator.h"
#include "shm/layout.h"

namespace {
void OnSignal(int sig) {
  if (sig == SIGINT) rp::coord::RequestGracefulStop();
  else rp::coord::RequestStop();
}
}  // namespace

int main(int argc, char** argv) {
  // SIGHUP, not SIGKILL, when the launcher dies: this process then removes the run's names.
  rp::BindLifetimeToLauncher(SIGHUP);
  rp::coord::CoordinatorOptions o;
  int verbosity = 0;
  CLI::App app{"RoundPipe coordinator (started by rp-launch)"};
  app.add_option("--spec", o.spec_path, "the run spec rp-launch wrote (run-spec.json)")->required();
  app.add_option("--gpus", o.num_workers, "number of workers")
      ->required()
      ->check(CLI::Range(1, 4096));
  app.add_option("--session", o.session, "session id")->required();
  app.add_option("--runtime-dir", o.runtime_dir, "private runtime directory")->required();
  app.add_option("--optimizer-threads", o.optimizer_threads, "CPU optimizer threads (0 = all)");
  app.add_option("--hello-timeout-s", o.hello_timeout_s,
                 "how long to wait for every worker to connect");
  app.add_flag("--resume", o.resume, "continue from the newest training checkpoint");
  app.add_option("-v", verbosity, "verbosity");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : rp::kExitBadConfig;
  }
  {
    // A SIGKILLed launcher cannot remove the run's shared memory and runtime directory; the
    // coordinator, told by SIGHUP, does (workers die with the launcher and need no cleanup).
    std::vector<std::string> names = {rp::shm::StateSegmentName(o.session),
                                      rp::shm::OptimSegmentName(o.session)};
    for (int r = 0; r < o.num_workers; ++r) names.push_back(rp::shm::PoolSegmentName(o.session, r));
    std::vector<std::string> paths;
    for (const auto& n : names) paths.push_back("/dev/shm/" + n);
    for (const auto& f : rp::RuntimeFileNames()) paths.push_back(o.runtime_dir + "/" + f);
    rp::RemoveOnLauncherDeath(paths, o.runtime_dir);
  }
  rp::InitLogging(argv[0], "coordinator");
  rp::SetVerbosity(verbosity);
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  bool replan = false;
  rp::Status s = rp::coord::RunCoordinator(o, &replan);
  if (!s.ok()) {
    RP_LOG(ERROR) << s.ToString();
    return rp::ExitCodeFor(s);
  }
  if (replan) {
    RP_LOG(INFO) << "stopped to re-plan; rp-launch resumes the run";
    return rp::kExitReplan;
  }
  RP_LOG(INFO) << "done";
  return 0;
}
