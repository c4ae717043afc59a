// SPDX-License-Identifier: Apache-2.0
// LogPump: collects the output of the run's processes.
//
// Contract:
//  * Pipe(role, path) returns the write end of a new pipe for a child's stdout and stderr (the
//    caller hands it to the child and closes its copy) and opens the log file `path` (appending).
//  * A background thread copies every line to the console unchanged (lines already carry the
//    process's role tag) and to that process's log file, and keeps the process's last lines for
//    a failure diagnosis (LastLines). When the console (stderr) is a terminal, the coordinator's
//    per-step lines are shown as one progress line rewritten in place (ProgressLine); the log
//    file still gets every line, and a console that is not a terminal gets plain lines.
//  * The destructor waits until every pipe reached end-of-file (all children exited and closed
//    their ends), then closes the files. It never throws.
#pragma once

#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace rp::launch {

// The progress-line text for a coordinator log line reporting a step ("step N/M loss ..."), or
// an empty string for any other line.
std::string ProgressLine(const std::string& log_line);

class LogPump {
 public:
  LogPump() = default;
  LogPump(const LogPump&) = delete;
  LogPump& operator=(const LogPump&) = delete;
  ~LogPump();

  StatusOr<int> Pipe(const std::string& role, const std::string& path);
  void Start();
  // Waits until every pipe reached end-of-file (all children exited).
  void Finish();
  std::string LastLines(const std::string& role) const;
  // The newest line of `role` containing `needle` (kept even after it scrolled out of LastLines),
  // or "". Tracked needles: "joined: device" (a worker's device) and "] step " (progress).
  std::string LastLineWith(const std::string& role, const std::string& needle) const;

 private:
  struct Source {
    std::string role;
    int read_fd = -1;
    int file_fd = -1;
    std::string partial;
    std::deque<std::string> last;                // GUARDED_BY(mu_)
    std::map<std::string, std::string> tracked;  // GUARDED_BY(mu_): needle -> newest line
  };
  bool console_is_tty_ = false;
  bool progress_shown_ =
      false;  // pump thread only: the console's cursor sits after a progress line
  void Loop();
  void Emit(Source& s, const std::string& line);

  std::vector<Source> sources_;
  mutable std::mutex mu_;
  std::thread thread_;  // last: joined before the sources go away
};

}  // namespace rp::launch
