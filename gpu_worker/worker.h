// SPDX-License-Identifier: Apache-2.0
// rp-worker: a stateless compute process.
//
// Role: connect to the coordinator, map the state segment, then loop: queue RunJob messages in
// arrival order (which is job order), run the head of the queue one microbatch at a time as
// InputReady messages arrive, report each microbatch, and commit gradients when granted. Nothing
// outlives a job except caches, so the process can die and be replaced.
//
// Threading: single-threaded; the one thread owns the control socket. Exits when told
// (Shutdown), when the launcher disappears, or on SIGINT/SIGTERM.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace rp::worker {

struct WorkerOptions {
  int rank = 0;
  std::string spec_path;  // the run spec rp-launch resolved (planning/run_spec.h)
  int num_workers = 1;
  std::string session;
  std::string runtime_dir;
  // How long to wait for Welcome once the coordinator listens (the join in worker.cc says when).
  int welcome_timeout_s = 120;
};

Status RunWorker(const WorkerOptions& options);
void RequestStop();  // async-signal-safe

}  // namespace rp::worker
