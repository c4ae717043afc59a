// SPDX-License-Identifier: Apache-2.0
// A slow disk for tests, without root: preloaded (LD_PRELOAD) into a run's processes, every
// write to a regular file first sleeps for its bytes at RP_SLOW_DISK_MB_S megabytes per second,
// plus RP_SLOW_DISK_WRITE_MS milliseconds per call (a disk queue that backs up small writes
// too). Pipes, sockets and other descriptors are untouched.
#include <dlfcn.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>

namespace {

double EnvNumber(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atof(v) : 0.0;
}

void Throttle(int fd, size_t bytes) {
  const double rate = EnvNumber("RP_SLOW_DISK_MB_S") * 1e6,
               per_call = EnvNumber("RP_SLOW_DISK_WRITE_MS") * 1e-3;
  struct stat st {};
  if ((rate <= 0 && per_call <= 0) || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return;
  const double s = (rate > 0 ? static_cast<double>(bytes) / rate : 0.0) + per_call;
  timespec t{static_cast<time_t>(s),
             static_cast<long>((s - static_cast<double>(static_cast<time_t>(s))) * 1e9)};
  while (::nanosleep(&t, &t) != 0) {
  }
}

template <typename Fn>
Fn Next(const char* name) {
  return reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, name));
}

}  // namespace

extern "C" {

ssize_t write(int fd, const void* buf, size_t n) {
  static const auto real = Next<ssize_t (*)(int, const void*, size_t)>("write");
  Throttle(fd, n);
  return real(fd, buf, n);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) {
  static const auto real = Next<ssize_t (*)(int, const void*, size_t, off_t)>("pwrite");
  Throttle(fd, n);
  return real(fd, buf, n, offset);
}

ssize_t pwrite64(int fd, const void* buf, size_t n, off64_t offset) {
  static const auto real = Next<ssize_t (*)(int, const void*, size_t, off64_t)>("pwrite64");
  Throttle(fd, n);
  return real(fd, buf, n, offset);
}

}  // extern "C"
