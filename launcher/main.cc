// SPDX-License-Identifier: Apache-2.0
// rp-launch --gpus N job.toml [--set section.key=value ...] [-v N] [--dry-run]
// rp-launch --gpus N RUN_DIR --resume   (the job the run keeps as RUN_DIR/job.toml)
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "common/closest_match.h"
#include "common/exit_codes.h"
#include "common/logging.h"
#include "config/job_config.h"
#include "launcher/launcher.h"
#include "launcher/node_world.h"

int main(int argc, char** argv) {
  rp::launch::LaunchOptions o;
  using rp::launch::NodeFlags;
  CLI::App app{"RoundPipe launcher: one coordinator and one worker per GPU"};
  const CLI::Validator worker_count(
      [](std::string& text) -> std::string {
        size_t used = 0;
        long value = 0;
        try {
          value = std::stol(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == text.size() && used > 0 && value >= 1 && value <= 4096) return "";
        return "\"" + text + "\" is not a number of workers (a whole number from 1 to 4096)";
      },
      "1..4096");
  app.add_option("--gpus", o.gpus,
                 "workers to start (one per GPU; CPU workers when job.device = cpu)")
      ->check(worker_count);
  app.add_option("job", o.job_path,
                 "job file (TOML); with --resume, or the run's output directory");
  app.add_option("--set", o.overrides, "override a job key: section.key=value (repeatable)");
  app.add_option("-v", o.verbosity, "log verbosity (0 = info)");
  app.add_flag("--dry-run", o.dry_run,
               "validate the job, print the plan and memory, start nothing");
  app.add_flag(
      "--resume", o.resume,
      "continue the run in job.output_dir (or the run directory given instead of the job file) "
      "from "
      "its newest training checkpoint (checkpoint.every, train.stop_after); the results equal an "
      "uninterrupted run's");
  app.add_flag(
      "--force-resume", o.force_resume,
      "with --resume: continue from a checkpoint whose run differs from the job in keys that "
      "decide "
      "the training (optimizer.lr, train.seed, ...; otherwise refused naming them), logging the "
      "differences");
  app.add_option("--debug-worker", o.debug_worker,
                 "start this worker stopped and print how to attach a debugger to it");
  app.add_option("--worker-wrapper", o.worker_wrapper,
                 "run workers under a tool, e.g. compute-sanitizer or valgrind");
  NodeFlags nodes;
  app.add_option("--nnodes", nodes.nnodes,
                 "nodes (hosts) of a multi-node run, one rp-launch on each")
      ->check(CLI::Range(1, 65536));
  app.add_option("--node-rank", nodes.node_rank, "this node's rank, 0 .. nnodes - 1")
      ->check(CLI::Range(0, 65535));
  app.add_option("--master", nodes.master,
                 "ADDR:PORT where node 0's rp-launch hosts the run's node store");
  bool print_keys = false;
  app.add_flag("--print-keys", print_keys, "print every job key as a Markdown table and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // An unknown flag is named with the flag it most likely meant.
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
      std::vector<std::string> flags;
      for (const CLI::Option* opt : app.get_options())
        for (const auto& name : opt->get_lnames()) flags.push_back("--" + name);
      for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        arg = arg.substr(0, arg.find('='));
        if (arg.rfind("--", 0) != 0 || std::find(flags.begin(), flags.end(), arg) != flags.end())
          continue;
        const std::string close = rp::ClosestMatch(arg, flags);
        std::fprintf(stderr, "rp-launch: %s: unknown flag%s (rp-launch --help lists them)\n",
                     arg.c_str(), close.empty() ? "" : ("; did you mean " + close + "?").c_str());
        return rp::kExitBadConfig;
      }
    }
    int rc = app.exit(e);
    return rc == 0 ? 0 : rp::kExitBadConfig;
  }
  if (print_keys) {
    std::printf("| key | type | default | meaning |\n|---|---|---|---|\n");
    for (auto k : rp::core::DocumentedKeys()) {
      for (size_t i = k.meaning.find('|'); i != std::string::npos; i = k.meaning.find('|', i + 2))
        k.meaning.replace(i, 1, "\\|");  // a bare pipe would split the Markdown cell
      std::printf("| `%s.%s` | %s | `%s` | %s |\n", k.section.c_str(), k.key.c_str(),
                  k.type.c_str(), k.default_value.c_str(), k.meaning.c_str());
    }
    return 0;
  }
  if (o.force_resume && !o.resume) {
    std::fprintf(stderr, "rp-launch: --force-resume goes with --resume\n");
    return rp::kExitBadConfig;
  }
  if (o.job_path.empty()) {
    std::fprintf(stderr, "rp-launch: a job file is required (rp-launch --help)\n");
    return rp::kExitBadConfig;
  }
  // --resume RUN_DIR: the job is the one the run keeps beside its outputs, and its outputs are
  // where the directory is now (it may have been moved).
  if (std::error_code dir_ec; std::filesystem::is_directory(o.job_path, dir_ec)) {
    const std::string dir = std::filesystem::absolute(o.job_path).lexically_normal().string();
    if (!o.resume) {
      std::fprintf(
          stderr,
          "rp-launch: %s is a directory; give a job file, or --resume to continue the run in it\n",
          o.job_path.c_str());
      return rp::kExitBadConfig;
    }
    o.job_path = dir + "/job.toml";
    if (!std::filesystem::is_regular_file(o.job_path, dir_ec)) {
      std::fprintf(
          stderr,
          "rp-launch: --resume %s: it holds no job.toml (a run writes it when it starts); give "
          "the job file the run started with: rp-launch JOB.toml --resume\n",
          dir.c_str());
      return rp::kExitBadConfig;
    }
    o.overrides.insert(o.overrides.begin(), "job.output_dir=" + nlohmann::json(dir).dump());
  }
  auto world = rp::launch::ResolveNodeWorld(nodes, rp::launch::ProcessEnv);
  if (!world.ok()) {
    std::fprintf(stderr, "rp-launch: %s\n", world.status().message().c_str());
    return rp::kExitBadConfig;
  }
  o.world = *world;
  rp::InitLogging(argv[0], "launch");
  std::error_code ec;
  o.bin_dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path().string();
  return rp::launch::RunLauncher(o);
}
