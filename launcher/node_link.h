// SPDX-License-Identifier: Apache-2.0
// NodeLink: one node's rp-launch in touch with the other nodes' (multi-node runs).
//
// Contract:
//  * Open() hosts the node store (node 0) or connects to it (the others), sealed with the run's
//    secret (nodes/store_seal.h; launcher/run_secret.h), then Meet() waits, up
//    to job.node_timeout_s, until every node has arrived with the same run (the caller's
//    fingerprint of the resolved spec: plan, workers, first step, keys); a node that resolved
//    another (other flags, another job file, a stored profile of its own, --resume on some
//    nodes only) is refused, naming it.
//  * Tick(), called by the supervision loop, beats once a second and watches the others: a node
//    that ended with a failure, or gave no beat for job.node_timeout_s (killed, host gone,
//    network cut), or a store that vanished (node 0 gone) yields the message naming it; so does
//    a value of the store that fails authentication (someone without the secret wrote it).
//  * Failing() tells the others at once that this node's run failed (they stop, naming it).
//    Diagnose() is for a run that failed here: it watches the others for a few seconds for a node
//    that is gone, else one that failed on its own, so the report names the cause, not its echo.
//  * An interrupt agreed across the nodes (common/stop_agreement.h): Interrupt() tells the others
//    this node was interrupted; InterruptedElsewhere() names a node that was, as the last Tick()
//    saw it (each launcher then interrupts its coordinator); Propose() posts this node's proposed
//    stop step and Agreed() is the largest of every node's once all have posted (a node that
//    ended its run whole counts as proposing the end; one that ended otherwise without proposing
//    is an error naming it, since no agreement can come). Interrupt() and Propose() fail naming
//    the store when it refuses. From the first of these on, another node that ends interrupted
//    (exit 3, a graceful stop) is expected, not a failure; one that stopped at once is.
//  * End() records how this node ended; node 0 then keeps the store up until every other node
//    has ended or stopped beating for the timeout, since the others use it until they end.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "common/status.h"
#include "config/job_config.h"
#include "nodes/node_store.h"

namespace rp::launch {

class NodeLink {
 public:
  static StatusOr<std::unique_ptr<NodeLink>> Open(const core::JobConfig& job,
                                                  const nodes::StoreSeal& seal);
  Status Meet(const std::string& plan);
  std::optional<std::string> Tick();
  void Failing(const std::string& failure);
  std::optional<std::string> Diagnose();
  void End(int exit_code, const std::string& failure);
  Status Interrupt();
  std::optional<int> InterruptedElsewhere();
  Status Propose(int64_t step);
  StatusOr<std::optional<int64_t>> Agreed();

 private:
  NodeLink(std::unique_ptr<nodes::NodeStore> store, const core::JobConfig& job);
  std::string Key(const std::string& what, int node) const;
  // The others' beats now; a node whose beat moved is seen alive at `now`.
  Status Look(double now);
  // Posts this node's next beat.
  Status Beat();
  // What Tick() and Diagnose() say of a store error: tampering as itself, else node 0 lost.
  std::string StoreLost(const Status& s) const;
  std::optional<std::string> FailedPeer();

  std::unique_ptr<nodes::NodeStore> store_;
  int nodes_, rank_;
  double timeout_s_;
  std::string where_;  // "host:port" of the store
  double last_beat_ = -1.0;
  int64_t beats_ = 0;  // this node's beats posted
  struct Seen {
    std::string beat;  // the newest beat read (empty: none yet)
    double at = 0.0;
    bool ended = false;
  };
  std::map<int, Seen> seen_;
  bool stopping_ = false;    // in an agreed stop: other nodes' graceful ends are expected
  int interrupted_by_ = -1;  // a peer whose interrupt Look() saw (-1: none)
};

}  // namespace rp::launch
