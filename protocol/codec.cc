// SPDX-License-Identifier: Apache-2.0
#include "protocol/codec.h"

#include <cstring>

namespace rp::proto {

const char* MsgTypeName(MsgType t) {
  switch (t) {
    case MsgType::kHello: return "Hello";
    case MsgType::kWelcome: return "Welcome";
    case MsgType::kRunJob: return "RunJob";
    case MsgType::kInputReady: return "InputReady";
    case MsgType::kMicrobatchDone: return "MicrobatchDone";
    case MsgType::kGradsReady: return "GradsReady";
    case MsgType::kCommitGrads: return "CommitGrads";
    case MsgType::kJobDone: return "JobDone";
    case MsgType::kJobFailed: return "JobFailed";
    case MsgType::kShutdown: return "Shutdown";
    case MsgType::kHeartbeat: return "Heartbeat";
    case MsgType::kLinkProbe: return "LinkProbe";
    case MsgType::kLayerTime: return "LayerTime";
    case MsgType::kRunEval: return "RunEval";
    case MsgType::kEvalDone: return "EvalDone";
    case MsgType::kActivationPool: return "ActivationPool";
    case MsgType::kStepUpdate: return "StepUpdate";
  }
  return "?";
}

size_t PayloadBytes(MsgType t) {
  switch (t) {
    case MsgType::kHello: return sizeof(Hello);
    case MsgType::kWelcome: return sizeof(Welcome);
    case MsgType::kRunJob: return sizeof(RunJob);
    case MsgType::kInputReady: return sizeof(InputReady);
    case MsgType::kMicrobatchDone: return sizeof(MicrobatchDone);
    case MsgType::kGradsReady: return sizeof(GradsReady);
    case MsgType::kCommitGrads: return sizeof(CommitGrads);
    case MsgType::kJobDone: return sizeof(JobDone);
    case MsgType::kJobFailed: return sizeof(JobFailed);
    case MsgType::kShutdown: return sizeof(Shutdown);
    case MsgType::kHeartbeat: return sizeof(Heartbeat);
    case MsgType::kLinkProbe: return sizeof(LinkProbe);
    case MsgType::kLayerTime: return sizeof(LayerTime);
    case MsgType::kRunEval: return sizeof(RunEval);
    case MsgType::kEvalDone: return sizeof(EvalDone);
    case MsgType::kActivationPool: return sizeof(ActivationPool);
    case MsgType::kStepUpdate: return sizeof(StepUpdate);
  }
  return 0;
}

MsgType TypeOfMessage(const Message& m) {
  return std::visit([](const auto& p) { return TypeOf<std::decay_t<decltype(p)>>(); }, m);
}

std::string Encode(const Message& m) {
  return std::visit(
      [](const auto& p) {
        using T = std::decay_t<decltype(p)>;
        static_assert(std::is_trivially_copyable_v<T>);
        FrameHeader h{kFrameMagic, kProtocolVersion, static_cast<uint16_t>(TypeOf<T>()),
                      static_cast<uint32_t>(sizeof(T)), 0};
        std::string out(sizeof(h) + sizeof(T), '\0');
        std::memcpy(out.data(), &h, sizeof(h));
        std::memcpy(out.data() + sizeof(h), &p, sizeof(T));
        return out;
      },
      m);
}

namespace {

template <typename T>
StatusOr<Message> DecodeAs(std::string_view payload) {
  if (payload.size() != sizeof(T))
    return Status::ProtocolError(std::string(MsgTypeName(TypeOf<T>())) + ": payload is " +
                                 std::to_string(payload.size()) + " bytes, expected " +
                                 std::to_string(sizeof(T)));
  T value;
  std::memcpy(&value, payload.data(), sizeof(T));
  return Message(value);
}

template <size_t N>
bool Terminated(const char (&s)[N]) {
  return std::memchr(s, '\0', N) != nullptr;
}

}  // namespace

StatusOr<Message> Decode(std::string_view frame) {
  if (frame.size() < sizeof(FrameHeader))
    return Status::ProtocolError("frame of " + std::to_string(frame.size()) +
                                 " bytes is shorter than the 16-byte header");
  FrameHeader h;
  std::memcpy(&h, frame.data(), sizeof(h));
  if (h.magic != kFrameMagic) return Status::ProtocolError("frame has a bad magic number");
  if (h.version != kProtocolVersion)
    return Status::ProtocolError("frame has protocol version " + std::to_string(h.version) +
                                 ", this build speaks " + std::to_string(kProtocolVersion));
  if (h.payload_bytes != frame.size() - sizeof(FrameHeader))
    return Status::ProtocolError("frame header announces " + std::to_string(h.payload_bytes) +
                                 " payload bytes, frame carries " +
                                 std::to_string(frame.size() - sizeof(FrameHeader)));
  if (h.type < kMinMsgType || h.type > kMaxMsgType)
    return Status::ProtocolError("frame has unknown message type " + std::to_string(h.type));
  std::string_view payload = frame.substr(sizeof(FrameHeader));
  StatusOr<Message> m = Status::Internal("unreachable");
  switch (static_cast<MsgType>(h.type)) {
    case MsgType::kHello: m = DecodeAs<Hello>(payload); break;
    case MsgType::kWelcome: m = DecodeAs<Welcome>(payload); break;
    case MsgType::kRunJob: m = DecodeAs<RunJob>(payload); break;
    case MsgType::kInputReady: m = DecodeAs<InputReady>(payload); break;
    case MsgType::kMicrobatchDone: m = DecodeAs<MicrobatchDone>(payload); break;
    case MsgType::kGradsReady: m = DecodeAs<GradsReady>(payload); break;
    case MsgType::kCommitGrads: m = DecodeAs<CommitGrads>(payload); break;
    case MsgType::kJobDone: m = DecodeAs<JobDone>(payload); break;
    case MsgType::kJobFailed: m = DecodeAs<JobFailed>(payload); break;
    case MsgType::kShutdown: m = DecodeAs<Shutdown>(payload); break;
    case MsgType::kHeartbeat: m = DecodeAs<Heartbeat>(payload); break;
    case MsgType::kLinkProbe: m = DecodeAs<LinkProbe>(payload); break;
    case MsgType::kLayerTime: m = DecodeAs<LayerTime>(payload); break;
    case MsgType::kRunEval: m = DecodeAs<RunEval>(payload); break;
    case MsgType::kEvalDone: m = DecodeAs<EvalDone>(payload); break;
    case MsgType::kActivationPool: m = DecodeAs<ActivationPool>(payload); break;
    case MsgType::kStepUpdate: m = DecodeAs<StepUpdate>(payload); break;
  }
  if (!m.ok()) return m;
  if (auto* w = std::get_if<Welcome>(&m.value()); w && !Terminated(w->segment_name))
    return Status::ProtocolError("Welcome: segment_name is not NUL-terminated");
  if (auto* f = std::get_if<JobFailed>(&m.value()); f && !Terminated(f->message))
    return Status::ProtocolError("JobFailed: message is not NUL-terminated");
  if (auto* t = std::get_if<LayerTime>(&m.value());
      t && (t->phase < 0 || t->phase > kMaxLayerPhase))
    return Status::ProtocolError("LayerTime: phase " + std::to_string(t->phase) +
                                 " is out of range");
  if (auto* d = std::get_if<MicrobatchDone>(&m.value());
      d && (d->flags & ~kKnownMicrobatchFlags) != 0)
    return Status::ProtocolError("MicrobatchDone: unknown flags " + std::to_string(d->flags));
  return m;
}

}  // namespace rp::proto
