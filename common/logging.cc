// SPDX-License-Identifier: Apache-2.0
#include "common/logging.h"

#include <atomic>
#include <ctime>
#include <sys/time.h>
#include <unistd.h>

namespace rp {
namespace {
std::atomic<int> g_verbosity{0};
std::string* g_tag = nullptr;

// glog 0.6 custom prefix: "I 16:02:42.123 [worker 2 pid 1234] file.cc:12] message". The tag
// names the process so interleaved console output from N workers stays attributable.
void PrefixFormatter(std::ostream& s, const google::LogMessageInfo& l, void*) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03d", l.time.hour(), l.time.min(), l.time.sec(),
                static_cast<int>(l.time.usec() / 1000));
  s << l.severity[0] << ' ' << buf << " [" << (g_tag ? *g_tag : std::string("rp")) << "] "
    << l.filename << ':' << l.line_number << ']';
}
}  // namespace

void InitLogging(const char* argv0, const std::string& tag) {
  if (g_tag != nullptr) return;
  g_tag = new std::string(tag);  // lives for the process: the formatter may run at exit
  google::InitGoogleLogging(argv0, &PrefixFormatter, nullptr);
  // The function, not FLAGS_logtostderr: libc10 of LibTorch builds without glog defines a symbol
  // of that name too, and which one a flag assignment binds to depends on link order.
  google::LogToStderr();
}

void SetVerbosity(int level) { g_verbosity.store(level, std::memory_order_relaxed); }
int Verbosity() { return g_verbosity.load(std::memory_order_relaxed); }

}  // namespace rp
