// SPDX-License-Identifier: Apache-2.0
// ZeroMQ control channels: a ROUTER in the coordinator, a DEALER per worker, over ipc:// sockets
// inside the run's private 0700 runtime directory.
//
// Contract:
//  * Each channel owns its context and socket (cppzmq RAII) and is used by one thread only.
//  * LINGER is 0 so shutdown never blocks on undelivered messages.
//  * Receive() returns std::nullopt on timeout. Frames that fail to decode, and frames from peers
//    whose routing id is not "w<rank>", are logged and dropped, never delivered: a malformed
//    message cannot crash or steer the receiver. dropped() counts them.
//  * The ROUTER is mandatory-routing: sending to a rank that is not connected is an error
//    (Unavailable), not a silent drop.
//  * The coordinator's side is reached through CoordinatorChannel, so its parts can be driven
//    in-process by a test's channel. Wake() is the one method any thread (and a signal handler)
//    may call: it ends the current or next Receive() early, which is how the coordinator's loop
//    learns of work that did not arrive as a message (the optimizer gave gradient slots back, a
//    plan search finished, a stop was requested) without polling on a timer.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "common/status.h"
#include "protocol/messages.h"

namespace rp::proto {

struct Envelope {
  int rank;
  Message message;
};

// What the coordinator needs of its control channel.
class CoordinatorChannel {
 public:
  virtual ~CoordinatorChannel() = default;
  // Unavailable when `rank` is not connected.
  virtual Status Send(int rank, const Message& m) = 0;
  // Waits up to timeout_ms; nullopt on timeout, on Wake(), or after dropping a bad frame.
  virtual StatusOr<std::optional<Envelope>> Receive(int timeout_ms) = 0;
  // Thread-safe and async-signal-safe.
  virtual void Wake() = 0;
};

class RouterChannel final : public CoordinatorChannel {
 public:
  static StatusOr<RouterChannel> Bind(const std::string& endpoint);
  RouterChannel(RouterChannel&&) noexcept;
  RouterChannel& operator=(RouterChannel&&) noexcept;
  ~RouterChannel() override;

  Status Send(int rank, const Message& m) override;
  StatusOr<std::optional<Envelope>> Receive(int timeout_ms) override;
  // Writes to an eventfd that Receive() polls beside the socket.
  void Wake() override;
  uint64_t dropped() const;

 private:
  struct Impl;
  explicit RouterChannel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class DealerChannel {
 public:
  static StatusOr<DealerChannel> Connect(const std::string& endpoint, int rank);
  DealerChannel(DealerChannel&&) noexcept;
  DealerChannel& operator=(DealerChannel&&) noexcept;
  ~DealerChannel();

  Status Send(const Message& m);
  StatusOr<std::optional<Message>> Receive(int timeout_ms);
  uint64_t dropped() const;

 private:
  struct Impl;
  explicit DealerChannel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rp::proto
