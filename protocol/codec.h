// SPDX-License-Identifier: Apache-2.0
// Framing for the message set in messages.h.
//
// Encode() never fails. Decode() never crashes on any input: wrong magic, version, type, size or
// an unterminated string field is a ProtocolError naming the problem.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "protocol/messages.h"

namespace rp::proto {

std::string Encode(const Message& m);
StatusOr<Message> Decode(std::string_view frame);
MsgType TypeOfMessage(const Message& m);
// The fixed payload size of a message type (what Decode() requires of a frame of that type).
size_t PayloadBytes(MsgType t);

// Copies `text` into a fixed char field, truncating and always NUL-terminating.
template <size_t N>
void CopyText(char (&dst)[N], std::string_view text) {
  size_t n = text.size() < N - 1 ? text.size() : N - 1;
  for (size_t i = 0; i < n; ++i) dst[i] = text[i];
  for (size_t i = n; i < N; ++i) dst[i] = '\0';
}

}  // namespace rp::proto
