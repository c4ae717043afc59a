// SPDX-License-Identifier: Apache-2.0
// WorkerTable: the coordinator's view of its workers, one part of the coordinator: who is
// connected (their pids), when each was last heard (WorkerLiveness), how a message reaches them,
// and the registration that starts a run (Hello, Welcome, and with activation pools the relay of
// every worker's pool handle to the others).
//
// Contract:
//  * Register() waits until every rank has said Hello with the run's layout hash (and, with
//    activation pools, announced its pool), welcomes each and relays the pool handles. It fails
//    with DeadlineExceeded or ProtocolError naming the rank, or Cancelled once should_stop().
//  * Receive() is the loop's only wait. The wait counts as listening time; time spent between
//    waits counts only when short (WorkerLiveness). Messages from ranks outside the run are
//    dropped with a warning.
//  * Send() with restarts allowed (job.max_worker_restarts > 0) treats an unreachable worker as
//    no error: its replacement gets the worker's jobs again. Without restarts it is the run's.
//  * Replace() welcomes a replacement that said Hello mid-run (same rank, same layout hash).
//  * CheckHung() SIGKILLs workers silent past job.worker_timeout_s (only real pids > 0), whose
//    replacements then take over; without restarts a hung worker ends the run. A silent worker
//    that is stopped (common/process_state.h) is waited for instead, for up to
//    job.stopped_timeout_s, with a warning each time the timeout passes again; once it runs
//    again it has a whole timeout to be heard. Past that bound it is hung, named as stopped.
//  * Not thread-safe: the coordinator's loop owns it; the channel's Wake() is the exception.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "coordinator/liveness.h"
#include "protocol/channel.h"
#include "protocol/messages.h"
#include "shm/layout.h"

namespace rp::coord {

class WorkerTable {
 public:
  struct Setup {
    int workers = 1;
    uint64_t layout_hash = 0;
    bool activation_pools = false;
    uint64_t pool_bytes = 0;
    std::string segment_name;  // the state segment every worker maps
    uint64_t segment_bytes = 0;
    int max_restarts = 0;
    double timeout_s = 0.0;          // job.worker_timeout_s
    double stopped_timeout_s = 0.0;  // job.stopped_timeout_s
    double grace_s = 120.0;          // a replacement's start-up before it can be judged hung
  };
  WorkerTable(proto::CoordinatorChannel& channel, Setup setup);

  // `on_link_probe` takes the link probes that arrive while the others register.
  Status Register(double timeout_s, const std::function<bool()>& should_stop,
                  const std::function<void(int, const proto::LinkProbe&)>& on_link_probe);
  // From here on silence counts (the loop's first turn).
  void StartWatching(double now);
  StatusOr<std::optional<proto::Envelope>> Receive(int timeout_ms);
  Status Send(int rank, const proto::Message& m);
  Status Replace(int rank, const proto::Hello& hello);
  Status CheckHung();
  void ShutdownAll(int exit_code);

  bool restarts_allowed() const { return setup_.max_restarts > 0; }
  int size() const { return setup_.workers; }
  int pid(int rank) const { return pids_[rank]; }
  const std::vector<int>& pids() const { return pids_; }
  // For summary.json: replacements welcomed mid-run, and workers killed as hung.
  int replacements() const { return replacements_; }
  int hung() const { return hung_; }

 private:
  Status Welcome(int rank);
  Status OnPool(int rank, const proto::ActivationPool& p);
  bool PoolsMissing() const;

  proto::CoordinatorChannel& channel_;
  Setup setup_;
  std::vector<int> pids_;
  std::vector<bool> welcomed_;
  std::vector<std::optional<proto::ActivationPool>> pools_;
  std::optional<WorkerLiveness> liveness_;
  // Per worker: when it was first found stopped while silent; < 0 when it was not at the last look.
  std::vector<double> stopped_since_;
  int replacements_ = 0, hung_ = 0;
};

}  // namespace rp::coord
