// SPDX-License-Identifier: Apache-2.0
#include "coordinator/worker_table.h"

#include <signal.h>

#include <algorithm>

#include "common/logging.h"
#include "common/process_state.h"
#include "common/time_util.h"
#include "protocol/codec.h"

namespace rp::coord {

WorkerTable::WorkerTable(proto::CoordinatorChannel& channel, Setup setup)
    : channel_(channel),
      setup_(std::move(setup)),
      pids_(setup_.workers, 0),
      welcomed_(setup_.workers, false),
      pools_(setup_.workers),
      stopped_since_(setup_.workers, -1.0) {}

bool WorkerTable::PoolsMissing() const {
  return setup_.activation_pools &&
         std::any_of(pools_.begin(), pools_.end(), [](const auto& p) { return !p.has_value(); });
}

Status WorkerTable::Welcome(int rank) {
  proto::Welcome w{};
  w.segment_bytes = setup_.segment_bytes;
  w.num_workers = setup_.workers;
  proto::CopyText(w.segment_name, setup_.segment_name);
  return channel_.Send(rank, w);
}

Status WorkerTable::OnPool(int rank, const proto::ActivationPool& p) {
  if (!setup_.activation_pools || p.rank != rank || p.bytes != setup_.pool_bytes)
    return Status::ProtocolError(
        "worker " + std::to_string(rank) + " announced an activation pool (rank " +
        std::to_string(p.rank) + ", " + std::to_string(p.bytes) + " bytes) that this run " +
        (setup_.activation_pools
             ? "does not expect (" + std::to_string(setup_.pool_bytes) + " bytes per worker)"
             : std::string("does not use")));
  if (pools_[rank])
    return Status::ProtocolError("worker " + std::to_string(rank) +
                                 " announced its activation pool twice");
  pools_[rank] = p;
  return Status::Ok();
}

Status WorkerTable::Register(
    double timeout_s, const std::function<bool()>& should_stop,
    const std::function<void(int, const proto::LinkProbe&)>& on_link_probe) {
  const int n = setup_.workers;
  int connected = 0;
  double deadline = MonoSeconds() + timeout_s;
  while (connected < n || PoolsMissing()) {
    if (should_stop()) return Status::Cancelled("stopped by signal while waiting for workers");
    if (MonoSeconds() > deadline)
      return Status::DeadlineExceeded(
          connected < n
              ? "only " + std::to_string(connected) + " of " + std::to_string(n) +
                    " workers connected within " + std::to_string(static_cast<int>(timeout_s)) +
                    " s"
              : "not every worker announced its activation pool within " +
                    std::to_string(static_cast<int>(timeout_s)) + " s of the last connecting");
    RP_ASSIGN_OR_RETURN(auto env, channel_.Receive(100));
    if (!env) continue;
    const bool known = env->rank < n;
    // Workers already welcomed send heartbeats while the others connect.
    if (std::holds_alternative<proto::Heartbeat>(env->message)) continue;
    if (const auto* probe = std::get_if<proto::LinkProbe>(&env->message); probe && known) {
      on_link_probe(env->rank, *probe);
      continue;
    }
    // With activation pools a welcomed worker announces its pool, or reports that it could not
    // make one (a welcomed worker has no job yet to fail). Strangers fall to the checks below.
    const bool welcomed = setup_.activation_pools && known && welcomed_[env->rank];
    if (const auto* pool = std::get_if<proto::ActivationPool>(&env->message); pool && welcomed) {
      RP_RETURN_IF_ERROR(OnPool(env->rank, *pool));
      continue;
    }
    if (const auto* failed = std::get_if<proto::JobFailed>(&env->message); failed && welcomed)
      return Status::Unavailable("worker " + std::to_string(env->rank) +
                                 " could not set up its activation pool: " + failed->message);
    const auto* hello = std::get_if<proto::Hello>(&env->message);
    if (!hello || !known || hello->rank != env->rank) {
      RP_LOG(WARNING) << "ignored " << proto::MsgTypeName(proto::TypeOfMessage(env->message))
                      << " from peer w" << env->rank << " during registration";
      continue;
    }
    if (hello->layout_hash != setup_.layout_hash)
      return Status::ProtocolError(
          "worker " + std::to_string(env->rank) +
          " computed a different shared-memory layout from the run spec (a different build?)");
    // A replacement would announce a new pool the others have not opened; nothing to re-run yet.
    if (welcomed)
      return Status::Unavailable(
          "worker " + std::to_string(env->rank) +
          " restarted while the activation pools were being set up (its log says why)");
    if (!welcomed_[env->rank]) {
      welcomed_[env->rank] = true;
      if (++connected == n) {
        RP_LOG(INFO) << "all " << n << " workers connected";
        deadline = MonoSeconds() + timeout_s;  // the pools': CUDA start-up of the last one
      }
    }
    pids_[env->rank] = hello->pid;
    RP_RETURN_IF_ERROR(Welcome(env->rank));
    RP_VLOG(1) << "worker " << env->rank << " (pid " << hello->pid << ") connected";
  }
  if (!setup_.activation_pools) return Status::Ok();
  for (int to = 0; to < n; ++to)
    for (int owner = 0; owner < n; ++owner)
      if (owner != to) RP_RETURN_IF_ERROR(channel_.Send(to, *pools_[owner]));
  RP_LOG(INFO) << "activation pools: " << n << " x " << (setup_.pool_bytes >> 20)
               << " MiB, handles relayed";
  return Status::Ok();
}

void WorkerTable::StartWatching(double now) {
  liveness_.emplace(setup_.workers, setup_.timeout_s, now);
}

StatusOr<std::optional<proto::Envelope>> WorkerTable::Receive(int timeout_ms) {
  liveness_->Listening(MonoSeconds());
  auto env = channel_.Receive(timeout_ms);
  const double now = MonoSeconds();
  liveness_->ListenedUntil(now, timeout_ms * 1e-3, /*caught_up=*/env.ok() && !*env);
  if (!env.ok() || !*env) return env;
  if ((*env)->rank >= setup_.workers) {
    RP_LOG(WARNING) << "dropped a message from unknown worker " << (*env)->rank;
    return std::optional<proto::Envelope>();
  }
  liveness_->Heard((*env)->rank, now);
  stopped_since_[(*env)->rank] = -1.0;
  return env;
}

Status WorkerTable::Send(int rank, const proto::Message& m) {
  Status s = channel_.Send(rank, m);
  if (s.ok() || !restarts_allowed()) return s;
  RP_VLOG(1) << "worker " << rank << " unreachable (" << s.message()
             << "); its replacement gets the job again";
  return Status::Ok();
}

Status WorkerTable::Replace(int rank, const proto::Hello& hello) {
  if (hello.rank != rank || hello.layout_hash != setup_.layout_hash)
    return Status::ProtocolError("replacement worker " + std::to_string(rank) +
                                 " computed a different shared-memory layout or rank");
  pids_[rank] = hello.pid;
  replacements_++;
  return Welcome(rank);
}

Status WorkerTable::CheckHung() {
  const double now = MonoSeconds();
  // Work done since the last wait (a checkpoint written on the loop) was deaf time.
  liveness_->Listening(now);
  for (const auto& v : liveness_->Hung(now, setup_.grace_s)) {
    const int r = v.rank;
    const std::string who =
        "worker " + std::to_string(r) + " (pid " + std::to_string(pids_[r]) + ")";
    std::string why = "sent nothing for " + std::to_string(static_cast<int>(v.silent_s)) +
                      " s (job.worker_timeout_s = " + FormatSeconds(liveness_->timeout_s()) + ")";
    const bool stopped = pids_[r] > 0 && ProcessStopped(pids_[r]);
    if (stopped || stopped_since_[r] >= 0) {
      if (stopped_since_[r] < 0) stopped_since_[r] = now - v.silent_s;
      const double waited = now - stopped_since_[r];
      if (!stopped) {
        // Running again and not heard yet: a whole timeout to speak from now.
        RP_LOG(WARNING) << who << " continues after " << FormatSeconds(waited) << " s stopped";
        stopped_since_[r] = -1.0;
        liveness_->Excuse(r, now);
        continue;
      }
      if (waited <= setup_.stopped_timeout_s) {
        RP_LOG(WARNING) << who
                        << " is stopped (SIGSTOP, Ctrl-Z or a debugger) and has sent nothing for "
                        << FormatSeconds(waited)
                        << " s; waiting for it to continue, up to job.stopped_timeout_s = "
                        << FormatSeconds(setup_.stopped_timeout_s) << " s";
        liveness_->Excuse(r, now);
        continue;
      }
      why = "has been stopped (SIGSTOP, Ctrl-Z or a debugger) for " +
            std::to_string(static_cast<int>(waited)) +
            " s, past job.stopped_timeout_s = " + FormatSeconds(setup_.stopped_timeout_s) + " s";
      stopped_since_[r] = -1.0;
    }
    hung_++;
    if (!restarts_allowed()) return Status::Unavailable(who + " " + why + ": hung");
    RP_LOG(ERROR) << who << " " << why << "; killing it (hung), its replacement takes over";
    if (pids_[r] > 0) ::kill(pids_[r], SIGKILL);
  }
  return Status::Ok();
}

void WorkerTable::ShutdownAll(int exit_code) {
  for (int w = 0; w < setup_.workers; ++w) {
    Status s = channel_.Send(w, proto::Shutdown{exit_code, 0});
    if (!s.ok()) RP_VLOG(1) << "shutdown of worker " << w << ": " << s.message();
  }
}

}  // namespace rp::coord
