// SPDX-License-Identifier: Apache-2.0
// rp-launch --gpus N job.toml [--set section.key=value ...] [-v N] [--dry-run]
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <filesystem>

#include "common/exit_codes.h"
#include "common/logging.h"
#include "launcher/launcher.h"

int main(int argc, char** argv) {
  rp::launch::LaunchOptions o;
  CLI::App app{"RoundPipe launcher: one coordinator and one worker per GPU"};
  app.add_option("--gpus", o.gpus, "workers to start (one per GPU; CPU workers when job.device = cpu)")
      ->check(CLI::Range(1, 4096));
  app.add_option("job", o.job_path, "job file (TOML)")->required();
  app.add_option("--set", o.overrides, "override a job key: section.key=value (repeatable)");
  app.add_option("-v", o.verbosity, "log verbosity (0 = info)");
  app.add_flag("--dry-run", o.dry_run, "validate the job, print the plan and memory, start nothing");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : rp::kExitBadConfig;
  }
  rp::InitLogging(argv[0], "launch");
  std::error_code ec;
  o.bin_dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path().string();
  return rp::launch::RunLauncher(o);
}
