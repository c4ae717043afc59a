// SPDX-License-Identifier: Apache-2.0
#include "common/status.h"

#include <cstring>

namespace rp {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kProtocolError: return "ProtocolError";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kDeadlineExceeded: return "DeadlineExceeded";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kNonFinite: return "NonFinite";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string_view message) {
  if (code != StatusCode::kOk) rep_ = std::make_shared<Rep>(Rep{code, std::string(message)});
}

Status Status::FromErrno(std::string_view what, int err) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  return IoError(m);
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(rep_->code)) + ": " + rep_->message;
}

Status Status::WithSuffix(std::string_view suffix) const {
  if (ok()) return *this;
  return Status(rep_->code, rep_->message + std::string(suffix));
}

}  // namespace rp
