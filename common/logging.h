// SPDX-License-Identifier: Apache-2.0
// Project logging macros on top of glog's classes.
//
// Why not glog's LOG/CHECK: LibTorch builds without glog (the GPU host's wheel) define their own
// LOG/CHECK/VLOG in c10/util/Logging.h, which silently replace glog's in any translation unit that
// includes torch headers. These macros name glog's classes directly, so they mean the same thing
// in every translation unit and every LibTorch build.
//
//   RP_LOG(INFO) << "...";   RP_LOG(WARNING), RP_LOG(ERROR), RP_LOG(FATAL)
//   RP_VLOG(1) << "...";     enabled by `-v N` on the command line (SetVerbosity)
//   RP_CHECK(cond) << "...";  broken invariant: logs FATAL with a stack trace and aborts
#pragma once

#include <glog/logging.h>

#include <string>

namespace rp {
// Initializes glog once per process: logs to stderr with `tag` (e.g. "worker 2") in each line.
void InitLogging(const char* argv0, const std::string& tag);
void SetVerbosity(int level);
int Verbosity();
}  // namespace rp

#define RP_LOG_INFO ::google::LogMessage(__FILE__, __LINE__, ::google::GLOG_INFO).stream()
#define RP_LOG_WARNING ::google::LogMessage(__FILE__, __LINE__, ::google::GLOG_WARNING).stream()
#define RP_LOG_ERROR ::google::LogMessage(__FILE__, __LINE__, ::google::GLOG_ERROR).stream()
#define RP_LOG_FATAL ::google::LogMessageFatal(__FILE__, __LINE__).stream()
#define RP_LOG(severity) RP_LOG_##severity

// The `?:` + LogMessageVoidify form (not `if/else`) keeps these safe inside an unbraced `if`.
#define RP_VLOG(level) \
  (::rp::Verbosity() < (level)) ? (void)0 : ::google::LogMessageVoidify() & RP_LOG_INFO

#define RP_CHECK(cond)                                                                            \
  (cond) ? (void)0                                                                                \
         : ::google::LogMessageVoidify() & ::google::LogMessageFatal(__FILE__, __LINE__).stream() \
                                               << "Check failed: " #cond " "
