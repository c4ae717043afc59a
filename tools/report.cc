// SPDX-License-Identifier: Apache-2.0
// rp-report OUTPUT_DIR: pictures of a finished (or interrupted) run.
//   OUTPUT_DIR/timeline.svg   one row per worker, one box per microbatch of a stage job, coloured by
//                             stage (forward blue, fused tail orange, backward green); empty space in
//                             a row is a bubble
//   OUTPUT_DIR/loss.svg       loss per optimizer step
// and prints each worker's busy share of the run. Reads trace.json and metrics.jsonl only.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/exit_codes.h"
#include "io/run_output.h"

namespace {

struct Box {
  int worker;
  double t0, t1;  // seconds from the first event
  std::string name, kind;
};

std::string Colour(const std::string& kind, int stage) {
  // Alternate two shades per kind so neighbouring stages stay distinguishable.
  const bool dark = stage % 2 == 0;
  if (kind == "forward") return dark ? "#3b6fb6" : "#6f9bd8";
  if (kind == "fused_tail") return dark ? "#e07b28" : "#f0a060";
  return dark ? "#3c9a50" : "#72c083";
}

bool ReadText(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  CLI::App app{"Timeline and loss pictures of a RoundPipe run"};
  app.add_option("output_dir", dir, "the run's job.output_dir")->required();
  CLI11_PARSE(app, argc, argv);

  std::string text;
  if (!ReadText(dir + "/trace.json", &text)) {
    std::fprintf(stderr, "rp-report: cannot read %s/trace.json\n", dir.c_str());
    return rp::kExitBadConfig;
  }
  nlohmann::json trace = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (trace.is_discarded() || !trace.contains("traceEvents")) {
    std::fprintf(stderr, "rp-report: %s/trace.json is not a trace file\n", dir.c_str());
    return rp::kExitBadConfig;
  }
  // Microbatch events carry the timing; job events carry the stage and kind.
  std::map<int64_t, nlohmann::json> jobs;
  for (const auto& e : trace["traceEvents"])
    if (e.value("cat", "") == "job") jobs[e["args"]["job_index"].get<int64_t>()] = e;
  std::vector<Box> boxes;
  double start = 1e300, end = 0;
  int workers = trace.value("otherData", nlohmann::json::object()).value("num_workers", 0);
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("cat", "") != "microbatch") continue;
    auto job = jobs.find(e["args"]["job_index"].get<int64_t>());
    if (job == jobs.end()) continue;
    const auto& ja = job->second["args"];
    Box b;
    b.worker = ja["worker_rank"].get<int>();
    b.t0 = e["ts"].get<double>() * 1e-6;
    b.t1 = b.t0 + e["dur"].get<double>() * 1e-6;
    b.name = e["name"].get<std::string>();
    b.kind = ja["kind"].get<std::string>();
    b.name += " (" + b.kind + ", stage " + std::to_string(ja["stage"].get<int>()) + ")";
    boxes.push_back(b);
    start = std::min(start, b.t0);
    end = std::max(end, b.t1);
    workers = std::max(workers, b.worker + 1);
  }
  if (boxes.empty()) {
    std::fprintf(stderr, "rp-report: %s/trace.json holds no microbatch events\n", dir.c_str());
    return rp::kExitBadConfig;
  }
  const double span = std::max(end - start, 1e-9);
  const double width = 1200, left = 90, row = 28, top = 30;
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width + left + 20 << "\" height=\""
      << top + row * workers + 40 << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<text x=\"" << left << "\" y=\"18\">" << dir << ": " << boxes.size()
      << " microbatches on " << workers << " workers over " << span << " s (empty = idle)</text>\n";
  std::vector<double> busy(workers, 0.0);
  for (int w = 0; w < workers; ++w)
    svg << "<text x=\"4\" y=\"" << top + row * w + 18 << "\">worker " << w << "</text>\n"
        << "<rect data-worker=\"" << w << "\" x=\"" << left << "\" y=\"" << top + row * w
        << "\" width=\"" << width << "\" height=\"" << row - 4 << "\" fill=\"#f2f2f2\"/>\n";
  for (const auto& b : boxes) {
    busy[b.worker] += b.t1 - b.t0;
    const int stage = std::atoi(b.name.substr(b.name.find("stage ") + 6).c_str());
    svg << "<rect class=\"mb\" x=\"" << left + (b.t0 - start) / span * width << "\" y=\""
        << top + row * b.worker << "\" width=\"" << std::max(0.5, (b.t1 - b.t0) / span * width)
        << "\" height=\"" << row - 4 << "\" fill=\"" << Colour(b.kind, stage) << "\"><title>"
        << b.name << "</title></rect>\n";
  }
  for (int i = 0; i <= 10; ++i)
    svg << "<text x=\"" << left + width * i / 10 << "\" y=\"" << top + row * workers + 16
        << "\" text-anchor=\"middle\">" << static_cast<int>(span * i / 10 * 1000) / 1000.0
        << " s</text>\n";
  svg << "</svg>\n";
  if (auto s = rp::core::WriteFileAtomically(dir + "/timeline.svg", svg.str()); !s.ok()) {
    std::fprintf(stderr, "rp-report: %s\n", s.message().c_str());
    return rp::kExitError;
  }

  std::vector<double> losses;
  std::vector<std::pair<size_t, double>> evals;  // (step index, eval loss)
  if (ReadText(dir + "/metrics.jsonl", &text)) {
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.contains("loss")) continue;
      if (j.contains("eval_loss")) evals.emplace_back(losses.size(), j["eval_loss"].get<double>());
      losses.push_back(j["loss"].get<double>());
    }
  }
  if (!losses.empty()) {
    double lo = *std::min_element(losses.begin(), losses.end());
    double hi = *std::max_element(losses.begin(), losses.end());
    for (const auto& e : evals) lo = std::min(lo, e.second), hi = std::max(hi, e.second);
    hi = std::max(hi, lo + 1e-9);
    auto x = [&](size_t i) { return 60 + 560.0 * static_cast<double>(i) / std::max<size_t>(1, losses.size() - 1); };
    auto y = [&](double v) { return 330 - 290 * (v - lo) / (hi - lo); };
    std::ostringstream plot;
    plot << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"360\" "
            "font-family=\"sans-serif\" font-size=\"12\">\n<text x=\"60\" y=\"18\">loss per step ("
         << losses.size() << " steps): " << losses.front() << " -> " << losses.back();
    if (!evals.empty()) plot << "; eval loss (orange): " << evals.front().second << " -> " << evals.back().second;
    plot << "</text>\n<polyline fill=\"none\" stroke=\"#3b6fb6\" stroke-width=\"2\" points=\"";
    for (size_t i = 0; i < losses.size(); ++i) plot << x(i) << "," << y(losses[i]) << " ";
    plot << "\"/>\n";
    if (!evals.empty()) {
      plot << "<polyline fill=\"none\" stroke=\"#e07b24\" stroke-width=\"2\" points=\"";
      for (const auto& e : evals) plot << x(e.first) << "," << y(e.second) << " ";
      plot << "\"/>\n";
      for (const auto& e : evals)
        plot << "<circle cx=\"" << x(e.first) << "\" cy=\"" << y(e.second) << "\" r=\"3\" fill=\"#e07b24\"/>\n";
    }
    plot << "<text x=\"4\" y=\"44\">" << hi << "</text><text x=\"4\" y=\"330\">" << lo
         << "</text>\n</svg>\n";
    if (auto s = rp::core::WriteFileAtomically(dir + "/loss.svg", plot.str()); !s.ok()) {
      std::fprintf(stderr, "rp-report: %s\n", s.message().c_str());
      return rp::kExitError;
    }
  }
  std::printf("%s: %zu microbatches, %d workers, %.3f s\n", dir.c_str(), boxes.size(), workers, span);
  double total = 0;
  for (int w = 0; w < workers; ++w) {
    std::printf("  worker %d busy %.1f%%\n", w, 100.0 * busy[w] / span);
    total += busy[w];
  }
  std::printf("  bubble ratio over the run %.1f%%\n  wrote %s/timeline.svg%s\n",
              100.0 * (1.0 - total / (span * workers)), dir.c_str(),
              losses.empty() ? "" : (" and " + dir + "/loss.svg").c_str());
  return 0;
}
