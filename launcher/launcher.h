// SPDX-License-Identifier: Apache-2.0
// rp-launch: starts one coordinator and N workers for a job and supervises them.
//
// Contract:
//  * The job file and overrides are validated before any process, directory or segment exists;
//    a bad job exits kExitBadConfig with one message naming the key.
//  * Children are direct children (posix_spawn, no shell). They die with the launcher
//    (PR_SET_PDEATHSIG) even if it is SIGKILLed; the coordinator first removes the run's names
//    (common/session.h RemoveOnLauncherDeath).
//  * The first failure decides the outcome: which process, its pid, exit code or signal. The
//    others are then stopped (SIGTERM, then SIGKILL).
//  * The first SIGINT/SIGTERM is passed to the coordinator alone, as SIGINT, so it ends the run
//    cleanly (a checkpoint, the summary); a second one sends SIGTERM to every child. The launcher
//    then exits kExitInterrupted.
//  * On every exit path the run's shared-memory segment and its 0700 runtime directory (control
//    socket) are removed.
//  * Several nodes (options.world): this node's rp-launch meets the others (launcher/node_link.h)
//    before starting anything; a node that fails or is lost stops every other node, each naming
//    it, within job.node_timeout_s.
//  * Every process's output goes to the console and to job.output_dir/logs/<session>/<role>.log;
//    a failure report ends with the failed process's last lines.
#pragma once

#include <string>
#include <vector>

#include "launcher/node_world.h"

namespace rp::launch {

struct LaunchOptions {
  int gpus = 1;
  std::string job_path;
  std::vector<std::string> overrides;
  int verbosity = 0;
  bool dry_run = false;
  bool resume = false;        // continue the run in job.output_dir from its newest checkpoint
  bool force_resume = false;  // ... even one whose run-defining keys differ from the job's
  std::string bin_dir;        // where rp-coordinator and rp-worker live (default: beside rp-launch)
  int debug_worker = -1;      // this worker starts stopped, for a debugger to attach
  std::string worker_wrapper;  // a tool to run workers under, e.g. compute-sanitizer
  NodeWorld world;             // which node of how many this is (node_world.h)
  // Set by rp-launch between launches of one run (a re-plan restarts it): the profile frozen for
  // planning, and re-planning turned off once the run has re-planned as often as allowed.
  std::string frozen_profile;
  bool replanning_off = false;
};

// Returns the process exit code (common/exit_codes.h).
int RunLauncher(const LaunchOptions& options);

}  // namespace rp::launch
