// SPDX-License-Identifier: Apache-2.0
#include "launcher/run_secret.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "common/unique_fd.h"
#include "nodes/store_seal.h"

namespace rp::launch {
namespace {

namespace fs = std::filesystem;

constexpr size_t kMinUserSecret = 16;
constexpr size_t kFileSecretHex = 64;

bool IsHex(const std::string& s) {
  return s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// Creates `path` holding a fresh secret unless it exists; either way it then exists whole.
Status CreateIfAbsent(const std::string& path) {
  unsigned char bytes[kFileSecretHex / 2];
  if (::getrandom(bytes, sizeof(bytes), 0) != static_cast<ssize_t>(sizeof(bytes)))
    return Status::FromErrno("random bytes for " + path, errno);
  const std::string hex =
      nodes::HexOf(std::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes))) + "\n";
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (fd.get() < 0) return Status::FromErrno("creating " + tmp, errno);
    if (::write(fd.get(), hex.data(), hex.size()) != static_cast<ssize_t>(hex.size()) ||
        ::fsync(fd.get()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      return Status::FromErrno("writing " + tmp, err);
    }
  }
  // link() never replaces: the node that links first decides the secret for all.
  const int linked = ::link(tmp.c_str(), path.c_str());
  const int err = errno;
  ::unlink(tmp.c_str());
  if (linked != 0 && err != EEXIST) return Status::FromErrno("creating " + path, err);
  return Status::Ok();
}

}  // namespace

StatusOr<RunSecret> ResolveRunSecret(const std::string& output_dir, const EnvLookup& env) {
  if (auto given = env(nodes::kRunSecretVariable); given && !given->empty()) {
    if (given->size() < kMinUserSecret)
      return Status::InvalidArgument(
          std::string(nodes::kRunSecretVariable) + " has " + std::to_string(given->size()) +
          " characters; a run's secret needs at least " + std::to_string(kMinUserSecret) +
          ", the same on every node (for example `export " + nodes::kRunSecretVariable +
          "=$(openssl rand -hex 32)` where the job is submitted), or unset it to use the "
          "node-secret file in the shared output directory");
    return RunSecret{*given, nodes::kRunSecretVariable, true};
  }
  std::error_code ec;
  fs::create_directories(output_dir, ec);
  if (ec) return Status::IoError("creating " + output_dir + " (job.output_dir): " + ec.message());
  const std::string path = (fs::path(output_dir) / kNodeSecretFile).string();
  RP_RETURN_IF_ERROR(CreateIfAbsent(path));
  // Only a file this user alone can read is a secret: not a link planted in a shared directory,
  // not someone else's file, not one others may read or write.
  const std::string refused =
      path +
      " is not a node secret of this user's alone (a regular file of yours, mode "
      "0600, not a link); delete it and every node of the next run makes a new one, "
      "or set " +
      std::string(nodes::kRunSecretVariable);
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (fd.get() < 0) {
    if (errno == ELOOP) return Status::InvalidArgument(refused);
    return Status::FromErrno("reading " + path, errno);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return Status::FromErrno("reading " + path, errno);
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 0077) != 0)
    return Status::InvalidArgument(refused);
  char text[kFileSecretHex + 2] = {};
  const ssize_t got = ::read(fd.get(), text, sizeof(text) - 1);
  if (got < 0) return Status::FromErrno("reading " + path, errno);
  std::string hex(text, static_cast<size_t>(got));
  if (!hex.empty() && hex.back() == '\n') hex.pop_back();
  if (hex.size() != kFileSecretHex || !IsHex(hex))
    return Status::InvalidArgument(
        path +
        " is not a node secret (64 hex digits); delete it and every node of the "
        "next run makes a new one, or set " +
        std::string(nodes::kRunSecretVariable));
  RunSecret out{hex, path, false};
  for (const char* id : {"SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"})
    if (auto job = env(id); job && !job->empty()) {
      out.value += "/" + std::string(id) + "=" + *job;
      out.source += " with " + std::string(id);
      break;
    }
  return out;
}

}  // namespace rp::launch
