// SPDX-License-Identifier: Apache-2.0
#include "tests/testing/process_harness.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

extern char** environ;

namespace rp::testing {

namespace fs = std::filesystem;

std::string BinDir() {
  const char* d = std::getenv("RP_BIN_DIR");
  return d ? d : RP_TEST_BIN_DIR;
}
std::string SourceDir() {
  const char* d = std::getenv("RP_SOURCE_DIR");
  return d ? d : RP_TEST_SOURCE_DIR;
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string MakeTempDir(const std::string& prefix) {
  std::string tmpl = "/tmp/" + prefix + "XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
  return buf.data();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<double> Losses(const std::string& metrics_path, const std::string& field) {
  std::vector<double> out;
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    out.push_back(j.contains(field) ? j.at(field).get<double>() : -1.0);
  }
  return out;
}

Process::Process(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  char tmpl[] = "/tmp/rp-test-outXXXXXX";
  int fd = ::mkstemp(tmpl);
  if (fd < 0) throw std::runtime_error("mkstemp failed");
  out_path_ = tmpl;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd, 1);
  posix_spawn_file_actions_adddup2(&fa, fd, 2);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_store;
  for (char** e = environ; *e; ++e) env_store.emplace_back(*e);
  for (auto& e : env) env_store.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int rc = ::posix_spawn(&pid_, argv[0].c_str(), &fa, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(fd);
  if (rc != 0) throw std::runtime_error("posix_spawn " + argv[0] + " failed");
}

Process::~Process() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  }
  ::unlink(out_path_.c_str());
}

std::string Process::OutputSoFar() const { return ReadFile(out_path_); }

ProcessResult Process::Wait(double timeout_s) {
  ProcessResult r;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  while (true) {
    pid_t p = ::waitpid(pid_, &status, WNOHANG);
    if (p == pid_) break;
    if (std::chrono::steady_clock::now() > deadline) {
      r.timed_out = true;
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  reaped_ = true;
  r.signaled = WIFSIGNALED(status);
  r.code = r.signaled ? WTERMSIG(status) : WEXITSTATUS(status);
  r.output = ReadFile(out_path_);
  return r;
}

ProcessResult RunProcess(const std::vector<std::string>& argv, double timeout_s,
                         const std::vector<std::string>& env) {
  Process p(argv, env);
  return p.Wait(timeout_s);
}

std::vector<std::string> LeftoverSegments() {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator("/dev/shm", ec)) {
    std::string n = e.path().filename().string();
    if (n.rfind("rp-", 0) == 0) out.push_back(n);
  }
  return out;
}

std::vector<pid_t> ChildrenOf(pid_t pid) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator("/proc", ec)) {
    std::string n = e.path().filename().string();
    if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = ReadFile(e.path().string() + "/stat");
    auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state;
    pid_t ppid;
    rest >> state >> ppid;
    if (ppid == pid && state != 'Z') out.push_back(static_cast<pid_t>(std::stol(n)));
  }
  return out;
}

}  // namespace rp::testing
