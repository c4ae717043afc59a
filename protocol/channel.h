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

class RouterChannel {
 public:
  static StatusOr<RouterChannel> Bind(const std::string& endpoint);
  RouterChannel(RouterChannel&&) noexcept;
  RouterChannel& operator=(RouterChannel&&) noexcept;
  ~RouterChannel();

  Status Send(int rank, const Message& m);
  StatusOr<std::optional<Envelope>> Receive(int timeout_ms);
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
