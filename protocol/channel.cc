// SPDX-License-Identifier: Apache-2.0
#include "protocol/channel.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/logging.h"
#include "common/unique_fd.h"
#include "protocol/codec.h"

namespace rp::proto {

struct RouterChannel::Impl {
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::router};
  UniqueFd wake;  // eventfd: Wake() adds, Receive() drains
  uint64_t dropped = 0;
};

struct DealerChannel::Impl {
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::dealer};
  uint64_t dropped = 0;
};

RouterChannel::RouterChannel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RouterChannel::RouterChannel(RouterChannel&&) noexcept = default;
RouterChannel& RouterChannel::operator=(RouterChannel&&) noexcept = default;
RouterChannel::~RouterChannel() = default;
DealerChannel::DealerChannel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DealerChannel::DealerChannel(DealerChannel&&) noexcept = default;
DealerChannel& DealerChannel::operator=(DealerChannel&&) noexcept = default;
DealerChannel::~DealerChannel() = default;
uint64_t RouterChannel::dropped() const { return impl_->dropped; }
uint64_t DealerChannel::dropped() const { return impl_->dropped; }

StatusOr<RouterChannel> RouterChannel::Bind(const std::string& endpoint) {
  try {
    auto impl = std::make_unique<Impl>();
    impl->wake = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (impl->wake.get() < 0)
      return Status::IoError(std::string("creating the control socket's wake-up eventfd: ") +
                             std::strerror(errno));
    impl->sock.set(zmq::sockopt::linger, 0);
    impl->sock.set(zmq::sockopt::router_mandatory, 1);
    // A replacement worker connects with its dead predecessor's routing id and takes it over.
    impl->sock.set(zmq::sockopt::router_handover, 1);
    impl->sock.bind(endpoint);
    return RouterChannel(std::move(impl));
  } catch (const zmq::error_t& e) {
    return Status::IoError("binding control socket " + endpoint + ": " + e.what());
  }
}

Status RouterChannel::Send(int rank, const Message& m) {
  std::string id = "w";
  id += std::to_string(rank);
  std::string frame = Encode(m);
  try {
    auto r1 = impl_->sock.send(zmq::buffer(id), zmq::send_flags::sndmore);
    auto r2 = impl_->sock.send(zmq::buffer(frame), zmq::send_flags::none);
    if (!r1 || !r2)
      return Status::Unavailable("sending to worker " + std::to_string(rank) + ": would block");
  } catch (const zmq::error_t& e) {
    return Status::Unavailable("sending " + std::string(MsgTypeName(TypeOfMessage(m))) +
                               " to worker " + std::to_string(rank) + ": " + e.what());
  }
  return Status::Ok();
}

void RouterChannel::Wake() {
  const uint64_t one = 1;
  // Only EAGAIN can fail here (the counter is full): a wake-up is pending anyway.
  [[maybe_unused]] ssize_t n = ::write(impl_->wake.get(), &one, sizeof(one));
}

StatusOr<std::optional<Envelope>> RouterChannel::Receive(int timeout_ms) {
  try {
    zmq::pollitem_t items[] = {{impl_->sock.handle(), 0, ZMQ_POLLIN, 0},
                               {nullptr, impl_->wake.get(), ZMQ_POLLIN, 0}};
    zmq::poll(items, 2, std::chrono::milliseconds(timeout_ms));
    if (items[1].revents & ZMQ_POLLIN) {
      uint64_t count = 0;
      [[maybe_unused]] ssize_t n = ::read(impl_->wake.get(), &count, sizeof(count));
    }
    if (!(items[0].revents & ZMQ_POLLIN)) return std::optional<Envelope>();
    std::vector<zmq::message_t> parts;
    auto n = zmq::recv_multipart(impl_->sock, std::back_inserter(parts), zmq::recv_flags::dontwait);
    if (!n) return std::optional<Envelope>();
    if (parts.size() != 2) {
      impl_->dropped++;
      RP_LOG(WARNING) << "dropped a control message with " << parts.size() << " parts";
      return std::optional<Envelope>();
    }
    std::string id = parts[0].to_string();
    int rank = -1;
    if (id.size() >= 2 && id.size() <= 6 && id[0] == 'w') {
      rank = 0;
      for (size_t i = 1; i < id.size(); ++i) {
        if (id[i] < '0' || id[i] > '9') {
          rank = -1;
          break;
        }
        rank = rank * 10 + (id[i] - '0');
      }
    }
    if (rank < 0) {
      impl_->dropped++;
      RP_LOG(WARNING) << "dropped a control message from an unknown peer";
      return std::optional<Envelope>();
    }
    auto m = Decode(parts[1].to_string_view());
    if (!m.ok()) {
      impl_->dropped++;
      RP_LOG(WARNING) << "dropped a malformed control message from worker " << rank << ": "
                      << m.status().message();
      return std::optional<Envelope>();
    }
    return std::optional<Envelope>(Envelope{rank, std::move(m).value()});
  } catch (const zmq::error_t& e) {
    if (e.num() == EINTR) return std::optional<Envelope>();
    return Status::IoError(std::string("receiving on the control socket: ") + e.what());
  }
}

StatusOr<DealerChannel> DealerChannel::Connect(const std::string& endpoint, int rank) {
  try {
    auto impl = std::make_unique<Impl>();
    impl->sock.set(zmq::sockopt::linger, 0);
    std::string id = "w";
    id += std::to_string(rank);
    impl->sock.set(zmq::sockopt::routing_id, id);
    impl->sock.connect(endpoint);
    return DealerChannel(std::move(impl));
  } catch (const zmq::error_t& e) {
    return Status::IoError("connecting control socket " + endpoint + ": " + e.what());
  }
}

Status DealerChannel::Send(const Message& m) {
  std::string frame = Encode(m);
  try {
    impl_->sock.send(zmq::buffer(frame), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    return Status::Unavailable(std::string("sending ") + MsgTypeName(TypeOfMessage(m)) +
                               " to the coordinator: " + e.what());
  }
  return Status::Ok();
}

StatusOr<std::optional<Message>> DealerChannel::Receive(int timeout_ms) {
  try {
    zmq::pollitem_t items[] = {{impl_->sock.handle(), 0, ZMQ_POLLIN, 0}};
    zmq::poll(items, 1, std::chrono::milliseconds(timeout_ms));
    if (!(items[0].revents & ZMQ_POLLIN)) return std::optional<Message>();
    zmq::message_t msg;
    auto n = impl_->sock.recv(msg, zmq::recv_flags::dontwait);
    if (!n) return std::optional<Message>();
    auto m = Decode(msg.to_string_view());
    if (!m.ok()) {
      impl_->dropped++;
      RP_LOG(WARNING) << "dropped a malformed control message from the coordinator: "
                      << m.status().message();
      return std::optional<Message>();
    }
    return std::optional<Message>(std::move(m).value());
  } catch (const zmq::error_t& e) {
    if (e.num() == EINTR) return std::optional<Message>();
    return Status::IoError(std::string("receiving on the control socket: ") + e.what());
  }
}

}  // namespace rp::proto
