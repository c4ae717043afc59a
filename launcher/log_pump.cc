// SPDX-License-Identifier: Apache-2.0
#include "launcher/log_pump.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>

namespace rp::launch {
namespace {
constexpr size_t kKeepLines = 12;

void WriteAll(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a full disk must not stop the run; the console still has the line
    done += static_cast<size_t>(n);
  }
}
}  // namespace

StatusOr<int> LogPump::Pipe(const std::string& role, const std::string& path) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::FromErrno("pipe for " + role + " output", errno);
  // A new file in the run's own new directory: never an existing file, never through a link.
  int file =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (file < 0) {
    Status s = Status::FromErrno("opening log file " + path, errno);
    ::close(fds[0]);
    ::close(fds[1]);
    return s;
  }
  Source src;
  src.role = role;
  src.read_fd = fds[0];
  src.file_fd = file;
  sources_.push_back(std::move(src));
  return fds[1];
}

std::string ProgressLine(const std::string& line) {
  const size_t at = line.find("] step ");
  if (at == std::string::npos || line.find("[coordinator]") == std::string::npos ||
      line.find(" tokens/s") == std::string::npos)
    return "";
  std::string text = line.substr(at + 2);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text;
}

void LogPump::Start() {
  console_is_tty_ = ::isatty(2) == 1;
  thread_ = std::thread([this] { Loop(); });
}

void LogPump::Finish() {
  if (thread_.joinable()) thread_.join();
  if (progress_shown_) WriteAll(2, "\n");
  progress_shown_ = false;
}

LogPump::~LogPump() {
  if (thread_.joinable()) thread_.join();
  for (auto& s : sources_) {
    if (s.read_fd >= 0) ::close(s.read_fd);
    if (s.file_fd >= 0) ::close(s.file_fd);
  }
}

void LogPump::Emit(Source& s, const std::string& line) {
  const std::string progress = console_is_tty_ ? ProgressLine(line) : "";
  if (!progress.empty()) {
    WriteAll(2, "\r\033[K" + progress);  // rewrite the progress line in place
    progress_shown_ = true;
  } else {
    if (progress_shown_) WriteAll(2, "\n");  // keep the last progress line, continue below it
    progress_shown_ = false;
    WriteAll(2, line);
  }
  WriteAll(s.file_fd, line);
  std::lock_guard<std::mutex> l(mu_);
  for (const char* needle : {"joined: device", "] step "})
    if (line.find(needle) != std::string::npos) s.tracked[needle] = line;
  s.last.push_back(line);
  if (s.last.size() > kKeepLines) s.last.pop_front();
}

void LogPump::Loop() {
  char buf[65536];
  while (true) {
    std::vector<pollfd> fds;
    std::vector<Source*> who;
    for (auto& s : sources_)
      if (s.read_fd >= 0) {
        fds.push_back({s.read_fd, POLLIN, 0});
        who.push_back(&s);
      }
    if (fds.empty()) return;
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Source& s = *who[i];
      ssize_t n = ::read(s.read_fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {  // end of file: the child and every copy of its write end are gone
        if (!s.partial.empty()) Emit(s, s.partial + "\n");
        s.partial.clear();
        ::close(s.read_fd);
        s.read_fd = -1;
        continue;
      }
      s.partial.append(buf, static_cast<size_t>(n));
      size_t pos;
      while ((pos = s.partial.find('\n')) != std::string::npos) {
        Emit(s, s.partial.substr(0, pos + 1));
        s.partial.erase(0, pos + 1);
      }
    }
  }
}

std::string LogPump::LastLines(const std::string& role) const {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& s : sources_)
    if (s.role == role) {
      std::string out;
      for (const auto& line : s.last) out += "    " + line;
      return out;
    }
  return "";
}

std::string LogPump::LastLineWith(const std::string& role, const std::string& needle) const {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& s : sources_)
    if (s.role == role) {
      auto it = s.tracked.find(needle);
      return it == s.tracked.end() ? "" : it->second;
    }
  return "";
}

}  // namespace rp::launch
