// SPDX-License-Identifier: Apache-2.0
// Status and StatusOr<T>: errors as values.
//
// Contract:
//  * Fallible functions return `[[nodiscard]] Status` or `StatusOr<T>`; exceptions never cross a
//    component API.
//  * An OK Status costs one null pointer; an error carries a code and a message that names what
//    failed. RP_RETURN_IF_ERROR / RP_ASSIGN_OR_RETURN append " @ file:line" once per frame, so a
//    message read at the top is a short backtrace.
//  * Thread-safety: a Status is a value; copies are independent.
#pragma once

#include <cerrno>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace rp {

enum class StatusCode : unsigned char {
  kOk = 0,
  kInvalidArgument,  // bad config, CLI, dataset, or message contents
  kNotFound,
  kAlreadyExists,
  kIoError,        // syscall, shm, socket failures
  kProtocolError,  // malformed or unexpected control message
  kUnavailable,    // peer died or went away
  kDeadlineExceeded,
  kInternal,  // broken invariant reported as a value (e.g. a caught c10::Error)
  kCancelled,
  kNonFinite,  // a loss or gradient norm that is not finite: training diverged
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string_view message);

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string_view m) { return {StatusCode::kInvalidArgument, m}; }
  static Status NotFound(std::string_view m) { return {StatusCode::kNotFound, m}; }
  static Status AlreadyExists(std::string_view m) { return {StatusCode::kAlreadyExists, m}; }
  static Status IoError(std::string_view m) { return {StatusCode::kIoError, m}; }
  static Status NonFinite(std::string_view m) { return {StatusCode::kNonFinite, m}; }
  static Status ProtocolError(std::string_view m) { return {StatusCode::kProtocolError, m}; }
  static Status Unavailable(std::string_view m) { return {StatusCode::kUnavailable, m}; }
  static Status DeadlineExceeded(std::string_view m) { return {StatusCode::kDeadlineExceeded, m}; }
  static Status Internal(std::string_view m) { return {StatusCode::kInternal, m}; }
  static Status Cancelled(std::string_view m) { return {StatusCode::kCancelled, m}; }
  // An IoError that appends strerror(err) to `what`.
  static Status FromErrno(std::string_view what, int err);

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  const std::string& message() const;
  std::string ToString() const;
  // Returns a copy whose message has `suffix` appended (used for the " @ file:line" trail).
  Status WithSuffix(std::string_view suffix) const;

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::shared_ptr<const Rep> rep_;
};

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : v_(std::move(status)) {}  // NOLINT: implicit by design
  StatusOr(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  const T* operator->() const { return &std::get<T>(v_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<Status, T> v_;
};

namespace detail {
inline Status ToStatus(Status s) { return s; }
// Appends the " @ file:line" trail, except to bad-input errors: those are read by users and are
// about their input (which the message names), not about our code.
inline Status Trail(const Status& s, const char* loc) {
  return s.code() == StatusCode::kInvalidArgument ? s : s.WithSuffix(loc);
}
template <typename T>
Status ToStatus(const StatusOr<T>& s) {
  return s.status();
}
}  // namespace detail

}  // namespace rp

#define RP_STRINGIFY_INNER(x) #x
#define RP_STRINGIFY(x) RP_STRINGIFY_INNER(x)
#define RP_LOC " @ " __FILE__ ":" RP_STRINGIFY(__LINE__)

#define RP_RETURN_IF_ERROR(expr)                                  \
  do {                                                            \
    ::rp::Status _rp_st = ::rp::detail::ToStatus((expr));         \
    if (!_rp_st.ok()) return ::rp::detail::Trail(_rp_st, RP_LOC); \
  } while (0)

#define RP_CONCAT_INNER(a, b) a##b
#define RP_CONCAT(a, b) RP_CONCAT_INNER(a, b)
#define RP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)                   \
  auto tmp = (expr);                                               \
  if (!tmp.ok()) return ::rp::detail::Trail(tmp.status(), RP_LOC); \
  lhs = std::move(tmp).value()
#define RP_ASSIGN_OR_RETURN(lhs, expr) \
  RP_ASSIGN_OR_RETURN_IMPL(RP_CONCAT(_rp_sor_, __LINE__), lhs, expr)

namespace rp {
// Runs a syscall-like callable, retrying while it fails with EINTR; returns its last result.
template <typename F>
long RetryOnEintr(F&& f) {
  long rc;
  do {
    rc = static_cast<long>(f());
  } while (rc == -1 && errno == EINTR);
  return rc;
}
}  // namespace rp
