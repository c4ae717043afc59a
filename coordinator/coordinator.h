// SPDX-License-Identifier: Apache-2.0
// rp-coordinator: owns the run's host state and drives the schedule.
//
// Role: creates the state segment (and is the only process that unlinks it), initializes the
// weights, accepts N workers, dispatches stage jobs round-robin, routes per-microbatch readiness
// between consecutive jobs, orders gradient commits, runs the optimizer, writes metrics.jsonl,
// summary.json and trace.json. It never runs layer compute and links no model code.
//
// Threading: one event-loop thread owns the control socket; the optimizer uses a thread pool
// inside a step. Failure: any Status error ends the run; workers are told to shut down and the
// segment name is removed by RAII on every path.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace rp::coord {

struct CoordinatorOptions {
  std::string spec_path;  // the run spec rp-launch resolved (planning/run_spec.h)
  int num_workers = 1;
  std::string session;
  std::string runtime_dir;
  int optimizer_threads = 0;      // 0: hardware concurrency
  int hello_timeout_s = 120;      // how long to wait for every worker to connect
  bool resume = false;            // continue from the newest training-state checkpoint
};

// Runs the whole job. Returns OK after the last step's metrics are written. With
// schedule.partition = "auto", a fresh profile may show that another plan is clearly faster
// (schedule.replan_gain): the run then stops after a checkpoint, returns OK with *replan set,
// and rp-launch resumes it on the plan made from <output_dir>/profile.json.
Status RunCoordinator(const CoordinatorOptions& options, bool* replan = nullptr);

// Asks a running coordinator to stop at once (async-signal-safe; the SIGTERM handler).
void RequestStop();
// Asks it to stop gracefully (async-signal-safe; the SIGINT handler): the step being drained
// finishes, a training checkpoint is written, and the run ends with Cancelled (exit code 3), so
// `rp-launch --resume` continues exactly.
void RequestGracefulStop();

}  // namespace rp::coord
