// SPDX-License-Identifier: Apache-2.0
// Test helpers for real processes: start a binary, capture its output, wait with a deadline,
// and check that nothing of ours is left in /dev/shm or the runtime directory.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace rp::testing {

struct ProcessResult {
  bool timed_out = false;
  bool signaled = false;
  int code = 0;        // exit code or signal number
  std::string output;  // stdout + stderr
};

// Directory of the built binaries (RP_BIN_DIR from CTest) and of the sources.
std::string BinDir();
std::string SourceDir();
// A fresh temporary directory under /tmp (not removed automatically).
std::string MakeTempDir(const std::string& prefix);
// A loopback TCP port nothing listens on now (the kernel's choice for port 0).
int FreePort();

class Process {
 public:
  // Starts argv with extra environment entries; output goes to a temp file.
  Process(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});
  ~Process();  // kills and reaps if still running
  pid_t pid() const { return pid_; }
  // Waits up to timeout_s; on timeout kills the process (SIGKILL) and reports timed_out.
  ProcessResult Wait(double timeout_s);
  std::string OutputSoFar() const;

 private:
  pid_t pid_ = -1;
  std::string out_path_;
  bool reaped_ = false;
};

ProcessResult RunProcess(const std::vector<std::string>& argv, double timeout_s,
                         const std::vector<std::string>& env = {});

// Names in /dev/shm that look like ours ("rp-*-state").
std::vector<std::string> LeftoverSegments();
// Children of `pid` (from /proc), e.g. the launcher's coordinator and workers.
std::vector<pid_t> ChildrenOf(pid_t pid);
std::string ReadFile(const std::string& path);
// The "loss" of every line of a metrics.jsonl file, in order.
// One value of `field` per line of metrics.jsonl (-1 where a line lacks it, e.g. eval_loss on
// steps without an evaluation).
std::vector<double> Losses(const std::string& metrics_path, const std::string& field = "loss");

}  // namespace rp::testing
