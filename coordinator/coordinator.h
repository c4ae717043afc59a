// SPDX-License-Identifier: Apache-2.0
// rp-coordinator: owns the run's host state and drives the schedule.
//
// Role: creates the state segment (and is the only process that unlinks it), initializes the
// weights, accepts N workers, dispatches stage jobs round-robin, routes per-microbatch readiness
// between consecutive jobs, orders gradient commits, runs the optimizer, writes metrics.jsonl,
// summary.json and trace.json. It never runs layer compute and links no model code.
//
// Parts (each with its own contract): HostState (the segments and their contents), WorkerTable
// (registration, liveness, sends), StepDispatch (stage jobs, feeding, commits), Evaluations (eval
// jobs and the update gate), RunProfiler (profile, drift, re-plan), RunTrace, and the CPU
// AsyncOptimizer. This file is the glue: it turns messages into calls on the parts and decides
// what a finished job means for checkpoints, evaluations and the next step.
//
// Threading: one event-loop thread owns the control channel. It sleeps until a message arrives
// or something it waits for happens elsewhere (the optimizer gave slots back or finished a step,
// the plan search ended, a signal came): those wake it through CoordinatorChannel::Wake(). The
// optimizer uses a thread pool. Failure: any Status error ends the run; workers are told to
// shut down and the segment names are removed by RAII on every path.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "protocol/channel.h"

namespace rp::coord {

struct CoordinatorOptions {
  std::string spec_path;  // the run spec rp-launch resolved (planning/run_spec.h)
  int num_workers = 1;
  std::string session;
  std::string runtime_dir;
  int optimizer_threads = 0;  // 0: hardware concurrency
  int hello_timeout_s = 120;  // how long to wait for every worker to connect
  bool resume = false;        // continue from the newest training-state checkpoint
};

// Runs the whole job. Returns OK after the last step's metrics are written. With several nodes,
// node 0 alone writes checkpoints and exports, every node reports the whole step's loss (its
// fused tail jobs' workers sum it across the nodes) and tokens, and no node re-plans on its own
// (they run one plan). With
// schedule.partition = "auto", a fresh profile may show that another plan is clearly faster
// (schedule.replan_gain): the run then stops after a checkpoint, returns OK with *replan set,
// and rp-launch resumes it on the plan made from <output_dir>/profile.json.
// `channel`: null binds the control socket in options.runtime_dir; otherwise the run talks to its
// workers through it (tests drive a whole run in-process with workers simulated on threads).
Status RunCoordinator(const CoordinatorOptions& options, bool* replan = nullptr,
                      proto::CoordinatorChannel* channel = nullptr);

// Asks a running coordinator to stop at once (async-signal-safe; the SIGTERM handler).
void RequestStop();
// Asks it to stop gracefully (async-signal-safe; the SIGINT handler): the step being drained
// finishes, a training checkpoint is written, and the run ends with Cancelled (exit code 3), so
// `rp-launch --resume` continues exactly.
void RequestGracefulStop();

}  // namespace rp::coord
