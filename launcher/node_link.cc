// SPDX-License-Identifier: Apache-2.0
#include "launcher/node_link.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <thread>

#include "common/exit_codes.h"
#include "common/time_util.h"

namespace rp::launch {
namespace {
constexpr double kBeatSeconds = 1.0;
// Diagnose(): a healthy node beats within this long.
constexpr double kDiagnoseSeconds = 3.0;
}  // namespace

StatusOr<std::unique_ptr<NodeLink>> NodeLink::Open(const core::JobConfig& job,
                                                   const nodes::StoreSeal& seal) {
  const auto& n = job.nodes;
  auto store = n.rank == 0 ? nodes::NodeStore::Host(n.store_host, static_cast<int>(n.store_port),
                                                    job.job.node_timeout_s, seal)
                           : nodes::NodeStore::Connect(n.store_host, static_cast<int>(n.store_port),
                                                       job.job.node_timeout_s, seal);
  if (!store.ok()) return store.status();
  return std::unique_ptr<NodeLink>(new NodeLink(std::move(store).value(), job));
}

NodeLink::NodeLink(std::unique_ptr<nodes::NodeStore> store, const core::JobConfig& job)
    : store_(std::move(store)),
      nodes_(static_cast<int>(job.nodes.count)),
      rank_(static_cast<int>(job.nodes.rank)),
      timeout_s_(job.job.node_timeout_s),
      where_(store_->address()) {}

std::string NodeLink::Key(const std::string& what, int node) const {
  return "rp/" + what + "/" + std::to_string(node);
}

Status NodeLink::Meet(const std::string& plan) {
  RP_RETURN_IF_ERROR(store_->Set(Key("plan", rank_), plan));
  std::vector<std::string> keys;
  for (int r = 0; r < nodes_; ++r) keys.push_back(Key("plan", r));
  if (Status s = store_->Wait(keys); !s.ok()) {
    std::string missing;
    for (int r = 0; r < nodes_; ++r) {
      auto v = store_->TryGet(Key("plan", r));
      if (v.ok() && !*v) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    return Status::Unavailable(
        "nodes " + (missing.empty() ? std::string("?") : missing) + " did not arrive at " + where_ +
        " within job.node_timeout_s = " + std::to_string(static_cast<int>(timeout_s_)) +
        " s (nodes meet only when they share the run's secret: the same RP_NODE_SECRET on "
        "every node, or job.output_dir on a file system they all see): " +
        s.message());
  }
  Status verdict;
  for (int r = 0; r < nodes_ && verdict.ok(); ++r) {
    RP_ASSIGN_OR_RETURN(auto theirs, store_->TryGet(Key("plan", r)));
    if (theirs && *theirs != plan)
      verdict = Status::InvalidArgument(
          "node " + std::to_string(r) + " resolved \"" + *theirs + "\", this node \"" + plan +
          "\": every node must resolve the same run (the same job file and --set, "
          "--gpus, and --resume on every node or none)");
  }
  // Node 0 hosts the store: it stays until every node has read the plans, so each gives the
  // verdict itself rather than finding the store gone.
  RP_RETURN_IF_ERROR(store_->Set(Key("met", rank_), "1"));
  if (rank_ == 0) {
    std::vector<std::string> met;
    for (int r = 0; r < nodes_; ++r) met.push_back(Key("met", r));
    RP_RETURN_IF_ERROR(store_->Wait(met));
  }
  RP_RETURN_IF_ERROR(verdict);
  const double now = MonoSeconds();
  for (int r = 0; r < nodes_; ++r)
    if (r != rank_) seen_[r] = Seen{"", now, false};
  return Status::Ok();
}

Status NodeLink::Look(double now) {
  for (auto& [r, seen] : seen_) {
    if (seen.ended) continue;
    RP_ASSIGN_OR_RETURN(auto end, store_->TryGet(Key("end", r)));
    if (end) {
      seen.ended = true;
      continue;
    }
    // A peer's interrupt, seen at the beat's pace like everything else here.
    if (interrupted_by_ < 0) {
      RP_ASSIGN_OR_RETURN(auto flag, store_->TryGet(Key("interrupt", r)));
      if (flag) interrupted_by_ = r;
    }
    RP_ASSIGN_OR_RETURN(auto beat, store_->TryGet(Key("beat", r)));
    if (beat && *beat != seen.beat) {
      seen.beat = *beat;
      seen.at = now;
    }
  }
  return Status::Ok();
}

Status NodeLink::Beat() { return store_->Set(Key("beat", rank_), std::to_string(++beats_)); }

std::string NodeLink::StoreLost(const Status& s) const {
  if (s.code() == StatusCode::kProtocolError)
    return "the node store at " + where_ + ": " + s.message();
  return "lost the node store at " + where_ +
         " (node 0's rp-launch): node 0 is gone or unreachable (" + s.message() + ")";
}

std::optional<std::string> NodeLink::FailedPeer() {
  for (const auto& [r, seen] : seen_) {
    // How it ended, else the notice of a failure it is still reporting.
    auto end = store_->TryGet(Key("end", r));
    if (end.ok() && !*end) end = store_->TryGet(Key("failing", r));
    if (!end.ok() || !*end || (*end)->rfind("0 ", 0) == 0) continue;
    const std::string& text = **end;
    // In an agreed stop the others end as this node will: interrupted, after the agreed step.
    if (stopping_ && text == std::to_string(kExitInterrupted) + " ") continue;
    if (text.rfind(std::to_string(kExitInterrupted) + " ", 0) == 0)
      return "node " + std::to_string(r) +
             " was interrupted (SIGINT or SIGTERM); the newest complete checkpoint "
             "resumes the run";
    return "node " + std::to_string(r) + " failed: " + text.substr(text.find(' ') + 1);
  }
  return std::nullopt;
}

std::optional<std::string> NodeLink::Tick() {
  const double now = MonoSeconds();
  if (now - last_beat_ < kBeatSeconds) return std::nullopt;
  last_beat_ = now;
  if (Status b = Beat(); !b.ok()) return StoreLost(b);
  if (Status s = Look(now); !s.ok()) return StoreLost(s);
  // A failed node may itself be the echo of one that is gone: Diagnose() tells them apart.
  if (auto failed = FailedPeer()) return Diagnose().value_or(*failed);
  for (const auto& [r, seen] : seen_)
    if (!seen.ended && now - seen.at > timeout_s_)
      return "node " + std::to_string(r) + " gave no sign of life for " +
             std::to_string(static_cast<int>(now - seen.at)) +
             " s (job.node_timeout_s = " + std::to_string(static_cast<int>(timeout_s_)) +
             "): its rp-launch was killed, its host is gone or the network to it is cut";
  return std::nullopt;
}

std::optional<std::string> NodeLink::Diagnose() {
  // A node that is gone is the cause; a node that failed on its own account comes next; the
  // others, reacting to either, fail alike and are its echo.
  const double start = MonoSeconds();
  std::map<int, std::string> first;
  while (MonoSeconds() - start < kDiagnoseSeconds) {
    (void)Beat();  // the others diagnose too: this node is alive
    if (Status s = Look(MonoSeconds()); !s.ok())
      return s.code() == StatusCode::kProtocolError
                 ? StoreLost(s)
                 : "node 0 (which hosts the node store at " + where_ + ") is gone or unreachable";
    for (const auto& [r, seen] : seen_)
      if (!first.count(r)) first[r] = seen.beat;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  for (const auto& [r, seen] : seen_)
    if (!seen.ended && seen.beat == first[r])
      return "node " + std::to_string(r) +
             " stopped beating (its rp-launch was killed, or its host is gone)";
  return FailedPeer();
}

Status NodeLink::Interrupt() {
  stopping_ = true;
  Status s = store_->Set(Key("interrupt", rank_), "1");
  if (!s.ok())
    return Status::Unavailable("telling the other nodes of the interrupt: " + s.message());
  return Status::Ok();
}

std::optional<int> NodeLink::InterruptedElsewhere() {
  if (interrupted_by_ < 0) return std::nullopt;
  stopping_ = true;
  return interrupted_by_;
}

Status NodeLink::Propose(int64_t step) {
  stopping_ = true;
  Status s = store_->Set(Key("stop", rank_), std::to_string(step));
  if (!s.ok())
    return Status::Unavailable("posting this node's stop step " + std::to_string(step) + ": " +
                               s.message());
  return Status::Ok();
}

StatusOr<std::optional<int64_t>> NodeLink::Agreed() {
  int64_t most = -1;
  for (int r = 0; r < nodes_; ++r) {
    RP_ASSIGN_OR_RETURN(auto step, store_->TryGet(Key("stop", r)));
    if (!step) {
      // A node that finished its run whole stops after the last step, whatever it proposes.
      RP_ASSIGN_OR_RETURN(auto end, store_->TryGet(Key("end", r)));
      if (end && end->rfind("0 ", 0) == 0) {
        most = std::numeric_limits<int64_t>::max();
        continue;
      }
      if (end)
        return Status::Unavailable(
            "node " + std::to_string(r) + " ended (exit " + end->substr(0, end->find(' ')) +
            ") before proposing a stop step, so the nodes cannot stop after the same step; "
            "--resume continues from the newest complete checkpoint");
      return std::optional<int64_t>();
    }
    char* end = nullptr;
    const long long value = std::strtoll(step->c_str(), &end, 10);
    if (step->empty() || *end != '\0' || value < 0)
      return Status::ProtocolError("node " + std::to_string(r) + " proposed to stop after \"" +
                                   *step + "\", not a step count");
    most = std::max(most, static_cast<int64_t>(value));
  }
  return std::optional<int64_t>(most);
}

// Its own key: node 0 keeps the store up until the others' final "end", which comes after their
// diagnosis.
void NodeLink::Failing(const std::string& failure) {
  (void)store_->Set(Key("failing", rank_), "1 " + failure);
}

void NodeLink::End(int exit_code, const std::string& failure) {
  (void)store_->Set(Key("end", rank_), std::to_string(exit_code) + " " + failure);
  if (rank_ != 0) return;
  // The others use the store until they end (their last sums, their end key): keep it up while
  // any of them still beats and has not ended.
  for (;;) {
    (void)Beat();
    bool all = true;
    for (int r = 1; r < nodes_ && all; ++r) {
      auto end = store_->TryGet(Key("end", r));
      all = end.ok() && end->has_value();
    }
    if (all) return;
    // A node that stopped beating will never end.
    if (Status s = Look(MonoSeconds()); !s.ok()) return;
    bool stale = false;
    for (const auto& [r, seen] : seen_)
      stale = stale || (!seen.ended && MonoSeconds() - seen.at > timeout_s_);
    if (stale) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace rp::launch
