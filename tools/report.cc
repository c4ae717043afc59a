// SPDX-License-Identifier: Apache-2.0
// rp-report RUN_DIR [--out DIR] [--steps A..B]: a run's report, finished or in progress.
//   DIR/report.html      one self-contained page (inline SVG, no scripts, nothing fetched): the
//                        run's summary, the training charts and the timeline
//   DIR/loss.svg, lr.svg, grad_norm.svg, tokens_per_s.svg
//                        against the step, with labelled axes, ticks, grid and units; loss.svg
//                        also holds the eval loss (one marker per evaluation)
//   DIR/timeline.svg     one lane per worker and one for the coordinator's optimizer: weight
//                        fetch, forward, fused tail, backward (with its recompute), gradient
//                        return and each layer's update, idle where a lane is empty; a dashed
//                        line where each step's first job starts; --steps zooms to steps A..B
// DIR defaults to RUN_DIR/report. Reads metrics.jsonl, trace.json (written when a run ends: a
// run in progress gets the page without a timeline), summary.json and job.toml. Prints each
// worker's busy share.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/exit_codes.h"
#include "io/run_output.h"

namespace {

namespace fs = std::filesystem;

// Sizes of text in the pictures, in CSS pixels; nothing smaller than 11.
constexpr int kTickFont = 11, kLabelFont = 12, kTitleFont = 14;

bool ReadText(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Num(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

// Ticks at 1, 2 or 5 times a power of ten, about `target` of them over [lo, hi]; the axis is
// widened to whole ticks.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks;
  std::string Label(double v) const {
    if (step >= 1 && std::fabs(v) < 1e7) return Num(v, 0);
    if (step >= 1e-4) return Num(v, static_cast<int>(std::ceil(-std::log10(step) - 1e-9)));
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.1e", v);
    return buf;
  }
};

Axis NiceAxis(double lo, double hi, int target, bool integer) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1.0 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  double step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  if (integer) step = std::max(1.0, std::round(step));
  Axis a;
  a.step = step;
  a.lo = std::floor(lo / step + 1e-9) * step;
  a.hi = std::ceil(hi / step - 1e-9) * step;
  for (double t = a.lo; t <= a.hi + step * 1e-6; t += step)
    a.ticks.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
  return a;
}

// Fewer ticks until their labels (about 0.62 em per character, plus a gap) fit between ticks.
Axis FittedAxis(double lo, double hi, double length_px, bool horizontal, bool integer) {
  for (int target = 8; target >= 2; --target) {
    Axis a = NiceAxis(lo, hi, target, integer);
    size_t widest = 0;
    for (double t : a.ticks) widest = std::max(widest, a.Label(t).size());
    const double per_tick = length_px / std::max<size_t>(1, a.ticks.size() - 1);
    const double needed = horizontal ? widest * kTickFont * 0.62 + 12 : kTickFont + 8;
    if (per_tick >= needed) return a;
  }
  return NiceAxis(lo, hi, 2, integer);
}

struct Series {
  std::string name, colour;
  std::vector<std::pair<double, double>> points;  // (step, value)
  bool markers = false;                           // a circle at each point (sparse series)
};

// One chart: title, axes with ticks, tick labels and titles, grid, one line per series and a
// legend naming them.
std::string Chart(const std::string& id, const std::string& title, const std::string& y_title,
                  const std::vector<Series>& series) {
  const double width = 600, height = 320, left = 78, right = 20, top = 40, bottom = 56;
  const double plot_w = width - left - right, plot_h = height - top - bottom;
  double x_lo = 1e300, x_hi = -1e300, y_lo = 1e300, y_hi = -1e300;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) {
      x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x);
      y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
    }
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"rp-chart\" id=\"" << id << "\" width=\""
    << width << "\" height=\"" << height << "\" font-family=\"sans-serif\">\n"
    << "<text class=\"title\" x=\"" << left << "\" y=\"22\" font-size=\"" << kTitleFont
    << "\" font-weight=\"bold\">" << Escape(title) << "</text>\n";
  if (x_lo > x_hi) {
    o << "<text x=\"" << left << "\" y=\"" << top + plot_h / 2 << "\" font-size=\"" << kLabelFont
      << "\">no values yet</text>\n</svg>\n";
    return o.str();
  }
  const Axis xa = FittedAxis(x_lo, x_hi, plot_w, true, true);
  const Axis ya = FittedAxis(y_lo, y_hi, plot_h, false, false);
  auto px = [&](double x) { return left + (x - xa.lo) / (xa.hi - xa.lo) * plot_w; };
  auto py = [&](double y) { return top + plot_h - (y - ya.lo) / (ya.hi - ya.lo) * plot_h; };
  o << "<g class=\"grid\" stroke=\"#e3e3e3\">\n";
  for (double t : xa.ticks)
    o << "<line class=\"grid\" x1=\"" << px(t) << "\" x2=\"" << px(t) << "\" y1=\"" << top
      << "\" y2=\"" << top + plot_h << "\"/>\n";
  for (double t : ya.ticks)
    o << "<line class=\"grid\" x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << py(t)
      << "\" y2=\"" << py(t) << "\"/>\n";
  o << "</g>\n<g class=\"x-axis\" font-size=\"" << kTickFont << "\">\n<line x1=\"" << left
    << "\" x2=\"" << left + plot_w << "\" y1=\"" << top + plot_h << "\" y2=\"" << top + plot_h
    << "\" stroke=\"#444\"/>\n";
  for (double t : xa.ticks)
    o << "<line x1=\"" << px(t) << "\" x2=\"" << px(t) << "\" y1=\"" << top + plot_h << "\" y2=\""
      << top + plot_h + 5 << "\" stroke=\"#444\"/><text class=\"tick-label\" x=\"" << px(t)
      << "\" y=\"" << top + plot_h + 18 << "\" text-anchor=\"middle\">" << xa.Label(t)
      << "</text>\n";
  o << "<text class=\"axis-title\" x=\"" << left + plot_w / 2 << "\" y=\"" << height - 10
    << "\" text-anchor=\"middle\" font-size=\"" << kLabelFont
    << "\">step (optimizer updates)</text>\n</g>\n"
    << "<g class=\"y-axis\" font-size=\"" << kTickFont << "\">\n<line x1=\"" << left << "\" x2=\""
    << left << "\" y1=\"" << top << "\" y2=\"" << top + plot_h << "\" stroke=\"#444\"/>\n";
  for (double t : ya.ticks)
    o << "<line x1=\"" << left - 5 << "\" x2=\"" << left << "\" y1=\"" << py(t) << "\" y2=\""
      << py(t) << "\" stroke=\"#444\"/><text class=\"tick-label\" x=\"" << left - 8 << "\" y=\""
      << py(t) + 4 << "\" text-anchor=\"end\">" << ya.Label(t) << "</text>\n";
  o << "<text class=\"axis-title\" transform=\"translate(16," << top + plot_h / 2
    << ") rotate(-90)\" text-anchor=\"middle\" font-size=\"" << kLabelFont << "\">"
    << Escape(y_title) << "</text>\n</g>\n";
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    o << "<polyline class=\"series\" fill=\"none\" stroke=\"" << s.colour
      << "\" stroke-width=\"2\" points=\"";
    for (const auto& [x, y] : s.points) o << px(x) << "," << py(y) << " ";
    o << "\"><title>" << Escape(s.name) << "</title></polyline>\n";
    if (s.markers)
      for (const auto& [x, y] : s.points)
        o << "<circle cx=\"" << px(x) << "\" cy=\"" << py(y) << "\" r=\"3\" fill=\"" << s.colour
          << "\"/>\n";
  }
  // The legend, top right, above the plot.
  o << "<g class=\"legend\" font-size=\"" << kLabelFont << "\">\n";
  double lx = width - right;
  for (auto it = series.rbegin(); it != series.rend(); ++it) {
    const double w = it->name.size() * kLabelFont * 0.62 + 22;
    lx -= w;
    o << "<rect x=\"" << lx << "\" y=\"12\" width=\"14\" height=\"4\" fill=\"" << it->colour
      << "\"/><text class=\"legend-entry\" x=\"" << lx + 18 << "\" y=\"19\">" << Escape(it->name)
      << "</text>\n";
  }
  o << "</g>\n</svg>\n";
  return o.str();
}

struct Event {
  int lane = 0;           // worker rank; the optimizer's lane is `workers`
  double t0 = 0, t1 = 0;  // seconds from the window's first event
  std::string part;       // legend entry
  std::string title;      // tooltip
};

// The parts of the timeline, in legend order, with their colours.
const std::vector<std::pair<std::string, std::string>> kParts = {
    {"weight fetch", "#9b7fc7"},
    {"forward", "#3b6fb6"},
    {"fused tail (forward and backward)", "#e07b28"},
    {"backward (with its recompute)", "#3c9a50"},
    {"gradient return", "#1f5f2c"},
    {"optimizer update", "#c0392b"},
    {"idle", "#f0f0f0"},
};

std::string PartColour(const std::string& part) {
  for (const auto& [p, c] : kParts)
    if (p == part) return c;
  return "#888";
}

struct Timeline {
  std::string svg;
  int workers = 0;
  size_t microbatches = 0;
  double span = 0;
  std::vector<double> busy;  // per worker, seconds inside microbatches
};

std::optional<Timeline> DrawTimeline(const nlohmann::json& trace, int64_t first_step,
                                     int64_t last_step, std::string* why) {
  Timeline tl;
  tl.workers = trace.value("otherData", nlohmann::json::object()).value("num_workers", 0);
  std::map<int64_t, nlohmann::json> jobs;  // job_index -> args of jobs inside the window
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("cat", "") != "job") continue;
    const auto& a = e["args"];
    const int64_t step = a.value("step", int64_t{0}) + 1;
    if (step < first_step || step > last_step) continue;
    nlohmann::json j = a;
    j["ts"] = e["ts"];
    j["dur"] = e["dur"];
    jobs[a["job_index"].get<int64_t>()] = j;
    tl.workers = std::max(tl.workers, a["worker_rank"].get<int>() + 1);
  }
  if (jobs.empty()) {
    *why = "no stage job of steps " + std::to_string(first_step) + ".." +
           std::to_string(last_step) + " in trace.json";
    return std::nullopt;
  }
  double origin = 1e300, end = 0;
  std::vector<Event> events;
  std::map<int64_t, double> step_start;   // step -> its first job's start (absolute, s)
  std::map<int64_t, double> last_mb_end;  // job -> its last microbatch's end
  for (const auto& e : trace["traceEvents"]) {
    const std::string cat = e.value("cat", "");
    const double t0 = e.value("ts", 0.0) * 1e-6, t1 = t0 + e.value("dur", 0.0) * 1e-6;
    if (cat == "microbatch") {
      auto job = jobs.find(e["args"]["job_index"].get<int64_t>());
      if (job == jobs.end()) continue;
      const auto& a = job->second;
      const std::string kind = a["kind"].get<std::string>();
      Event ev;
      ev.lane = a["worker_rank"].get<int>();
      ev.t0 = t0, ev.t1 = t1;
      ev.part = kind == "forward"      ? "forward"
                : kind == "fused_tail" ? "fused tail (forward and backward)"
                                       : "backward (with its recompute)";
      ev.title = e.value("name", "") + ": step " + std::to_string(a["step"].get<int64_t>() + 1) +
                 ", stage " + std::to_string(a["stage"].get<int>()) + ", " + Num(t1 - t0, 4) + " s";
      events.push_back(ev);
      auto& m = last_mb_end[job->first];
      m = std::max(m, t1);
      tl.microbatches++;
    } else if (cat == "optimizer") {
      const int64_t step = e["args"].value("step", int64_t{0}) + 1;
      if (step < first_step || step > last_step) continue;
      Event ev;
      ev.lane = -1;  // placed once the worker count is known
      ev.t0 = t0, ev.t1 = t1;
      ev.part = "optimizer update";
      ev.title =
          e.value("name", "") + " of step " + std::to_string(step) + ", " + Num(t1 - t0, 4) + " s";
      events.push_back(ev);
    }
  }
  for (const auto& [index, a] : jobs) {
    const double t0 = a["ts"].get<double>() * 1e-6, t1 = t0 + a["dur"].get<double>() * 1e-6;
    const int64_t step = a["step"].get<int64_t>() + 1;
    auto& s = step_start.emplace(step, t0).first->second;
    s = std::min(s, t0);
    const double fetch = a.value("fetch_us", 0.0) * 1e-6;
    const std::string name = "job " + std::to_string(index) + " (step " + std::to_string(step) +
                             ", stage " + std::to_string(a["stage"].get<int>()) + ")";
    if (fetch > 0)
      events.push_back({a["worker_rank"].get<int>(), t0, t0 + fetch, "weight fetch",
                        name + ": weights fetched in " + Num(fetch, 4) + " s"});
    // After its last microbatch a tail or backward job hands its gradients back.
    auto mb = last_mb_end.find(index);
    if (a["kind"].get<std::string>() != "forward" && mb != last_mb_end.end() && t1 > mb->second)
      events.push_back({a["worker_rank"].get<int>(), mb->second, t1, "gradient return",
                        name + ": gradients returned in " + Num(t1 - mb->second, 4) + " s"});
  }
  for (auto& ev : events) {
    if (ev.lane < 0) ev.lane = tl.workers;
    origin = std::min(origin, ev.t0);
    end = std::max(end, ev.t1);
  }
  tl.span = std::max(end - origin, 1e-9);
  tl.busy.assign(tl.workers, 0.0);
  const int lanes = tl.workers + 1;
  const double width = 1100, left = 92, right = 20, lane_h = 26, top = 52;
  const double plot_h = lanes * lane_h;
  auto px = [&](double t) { return left + (t - origin) / tl.span * width; };
  std::ostringstream o;
  const double legend_y = top + plot_h + 62;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"rp-timeline\" id=\"timeline\" width=\""
    << left + width + right << "\" height=\"" << legend_y + 30
    << "\" font-family=\"sans-serif\">\n<text class=\"title\" x=\"" << left
    << "\" y=\"20\" font-size=\"" << kTitleFont << "\" font-weight=\"bold\">Steps " << first_step
    << ".."
    << std::min<int64_t>(last_step, step_start.empty() ? last_step : step_start.rbegin()->first)
    << ": " << tl.microbatches << " microbatches on " << tl.workers << " workers, "
    << Num(tl.span, 3) << " s</text>\n";
  for (int lane = 0; lane < lanes; ++lane) {
    const double y = top + lane * lane_h;
    const bool optimizer = lane == tl.workers;
    o << "<g class=\"lane\" "
      << (optimizer ? "data-lane=\"optimizer\"" : "data-worker=\"" + std::to_string(lane) + "\"")
      << "><rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << width << "\" height=\""
      << lane_h - 4 << "\" fill=\"" << PartColour("idle") << "\"/><text class=\"lane-label\" x=\""
      << left - 8 << "\" y=\"" << y + lane_h / 2 + 2 << "\" text-anchor=\"end\" font-size=\""
      << kLabelFont << "\">"
      << (optimizer ? std::string("optimizer") : "worker " + std::to_string(lane))
      << "</text></g>\n";
  }
  for (const auto& ev : events) {
    const double y = top + ev.lane * lane_h;
    if (ev.part != "weight fetch" && ev.part != "gradient return" &&
        ev.part != "optimizer update" && ev.lane < tl.workers)
      tl.busy[ev.lane] += ev.t1 - ev.t0;
    o << "<rect class=\""
      << (ev.part == "forward" || ev.part.rfind("fused", 0) == 0 ||
                  ev.part.rfind("backward", 0) == 0
              ? "mb"
              : "part")
      << "\" data-part=\"" << Escape(ev.part) << "\" x=\"" << px(ev.t0) << "\" y=\"" << y
      << "\" width=\"" << std::max(0.5, (ev.t1 - ev.t0) / tl.span * width) << "\" height=\""
      << lane_h - 4 << "\" fill=\"" << PartColour(ev.part) << "\"><title>" << Escape(ev.title)
      << "</title></rect>\n";
  }
  // Step boundaries: where each step's first job starts; labels thinned so that none overlap.
  const double min_label_gap = 8 * kLabelFont * 0.62;
  double last_label = -1e300;
  for (const auto& [step, t] : step_start) {
    const double x = px(t);
    o << "<line class=\"step-boundary\" data-step=\"" << step << "\" x1=\"" << x << "\" x2=\"" << x
      << "\" y1=\"" << top - 6 << "\" y2=\"" << top + plot_h
      << "\" stroke=\"#222\" stroke-dasharray=\"4 3\"/>\n";
    if (x - last_label >= min_label_gap) {
      o << "<text class=\"step-label\" x=\"" << x + 3 << "\" y=\"" << top - 9 << "\" font-size=\""
        << kTickFont << "\">step " << step << "</text>\n";
      last_label = x;
    }
  }
  const Axis ta = FittedAxis(0, tl.span, width, true, false);
  o << "<g class=\"x-axis\" font-size=\"" << kTickFont << "\">\n";
  for (double t : ta.ticks) {
    if (t > tl.span * (1 + 1e-9)) continue;
    const double x = left + t / tl.span * width;
    o << "<line x1=\"" << x << "\" x2=\"" << x << "\" y1=\"" << top + plot_h - 4 << "\" y2=\""
      << top + plot_h + 1 << "\" stroke=\"#444\"/><text class=\"tick-label\" x=\"" << x << "\" y=\""
      << top + plot_h + 14 << "\" text-anchor=\"middle\">" << ta.Label(t) << "</text>\n";
  }
  o << "<text class=\"axis-title\" x=\"" << left + width / 2 << "\" y=\"" << top + plot_h + 32
    << "\" text-anchor=\"middle\" font-size=\"" << kLabelFont
    << "\">time since the window's first event (s)</text>\n"
    << "</g>\n<g class=\"legend\" font-size=\"" << kLabelFont << "\">\n";
  double lx = left;
  for (const auto& [part, colour] : kParts) {
    o << "<rect x=\"" << lx << "\" y=\"" << legend_y - 10 << "\" width=\"12\" height=\"12\" fill=\""
      << colour << "\" stroke=\"#999\"/><text class=\"legend-entry\" x=\"" << lx + 16 << "\" y=\""
      << legend_y << "\">" << Escape(part) << "</text>\n";
    lx += part.size() * kLabelFont * 0.62 + 34;
  }
  o << "</g>\n</svg>\n";
  tl.svg = o.str();
  return tl;
}

bool ParseSteps(const std::string& text, int64_t* a, int64_t* b) {
  const auto dots = text.find("..");
  if (dots == std::string::npos) return false;
  try {
    size_t used = 0;
    *a = std::stoll(text.substr(0, dots), &used);
    if (used != dots) return false;
    *b = std::stoll(text.substr(dots + 2), &used);
    if (used != text.size() - dots - 2) return false;
  } catch (const std::exception&) {
    return false;
  }
  return *a >= 1 && *b >= *a;
}

struct Picture {
  std::string file, svg;
};

// The summary's rows: the job, its plan, the run's figures. `job_name` becomes the job's name
// where the run directory's job.toml names it.
std::vector<std::pair<std::string, std::string>> SummaryRows(
    const std::string& dir, const std::vector<nlohmann::json>& lines, const Series& eval,
    std::string* job_name) {
  std::string text;
  nlohmann::json summary = nlohmann::json::object();
  if (ReadText(dir + "/summary.json", &text)) {
    auto j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_object()) summary = j;
  }
  std::string plan = summary.value("plan", std::string());
  std::vector<std::pair<std::string, std::string>> rows;
  rows.push_back({"run directory", fs::absolute(dir).lexically_normal().string()});
  rows.push_back({"status", summary.value("status", std::string("no summary.json yet"))});
  if (!plan.empty()) rows.push_back({"plan", plan});
  if (!lines.empty()) {
    rows.push_back({"steps reported", std::to_string(lines.front()["step"].get<int64_t>()) + ".." +
                                          std::to_string(lines.back()["step"].get<int64_t>())});
    rows.push_back({"loss", Num(lines.front().value("loss", 0.0), 4) + " at the first step, " +
                                Num(lines.back().value("loss", 0.0), 4) + " at the last"});
    if (!eval.points.empty())
      rows.push_back({"eval loss", Num(eval.points.back().second, 4) + " at step " +
                                       Num(eval.points.back().first, 0)});
    if (lines.back().contains("elapsed_s"))
      rows.push_back({"elapsed", Num(lines.back()["elapsed_s"].get<double>(), 1) + " s"});
    if (lines.back().contains("host_gib"))
      rows.push_back({"host memory", Num(lines.back()["host_gib"].get<double>(), 2) + " GiB"});
    if (lines.back().contains("device_peak_gib"))
      rows.push_back(
          {"device memory peak", Num(lines.back()["device_peak_gib"].get<double>(), 2) + " GiB"});
  }
  if (summary.contains("tokens_per_s"))
    rows.push_back({"tokens/s (whole run)", Num(summary["tokens_per_s"].get<double>(), 0)});
  if (summary.contains("wall_s"))
    rows.push_back({"wall time", Num(summary["wall_s"].get<double>(), 1) + " s"});
  if (ReadText(dir + "/job.toml", &text)) {
    const auto at = text.find("\nname = ");
    if (at != std::string::npos) {
      const auto q = text.find_first_of("'\"", at);
      const auto q2 = q == std::string::npos ? q : text.find(text[q], q + 1);
      if (q2 != std::string::npos) *job_name = text.substr(q + 1, q2 - q - 1);
    }
    rows.push_back({"job", "job.toml in the run directory (the job as resolved)"});
  }
  return rows;
}

std::string ReportHtml(const std::string& job_name,
                       const std::vector<std::pair<std::string, std::string>>& rows,
                       const std::vector<Picture>& charts, const std::optional<Timeline>& timeline,
                       const std::string& no_timeline) {
  std::ostringstream html;
  html << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>RoundPipe "
          "run "
       << Escape(job_name)
       << "</title>\n<style>\nbody { font-family: sans-serif; margin: 24px; color: #222; }\n"
       << "h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; }\n"
       << "table { border-collapse: collapse; } td, th { padding: 3px 12px 3px 0; font-size: 14px; "
          "text-align: left; "
          "vertical-align: top; }\n.charts { display: flex; flex-wrap: wrap; gap: 16px; }\n"
       << ".note { font-size: 14px; color: #555; }\n</style>\n</head>\n<body>\n<h1>RoundPipe run "
       << Escape(job_name) << "</h1>\n<h2>Summary</h2>\n<table id=\"summary\">\n";
  for (const auto& [k, v] : rows)
    html << "<tr><th>" << Escape(k) << "</th><td>" << Escape(v) << "</td></tr>\n";
  html << "</table>\n<h2>Training</h2>\n<div class=\"charts\">\n";
  for (const auto& c : charts) html << c.svg;
  html << "</div>\n<h2>Timeline</h2>\n";
  if (timeline)
    html << "<p class=\"note\">Hover a box for its job, stage and duration. Recompute runs inside "
            "each backward "
            "job's microbatches and is drawn with them.</p>\n"
         << timeline->svg;
  else
    html << "<p class=\"note\" id=\"no-timeline\">No timeline: " << Escape(no_timeline)
         << ".</p>\n";
  html << "</body>\n</html>\n";
  return html.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, out, steps;
  CLI::App app{"The report of a RoundPipe run: summary, training charts and timeline"};
  app.add_option("run_dir", dir, "the run's job.output_dir")->required();
  app.add_option("--out", out, "where report.html and the SVGs go (default RUN_DIR/report)");
  app.add_option("--steps", steps, "draw the timeline of steps A..B only (1-based, inclusive)");
  CLI11_PARSE(app, argc, argv);
  if (out.empty()) out = dir + "/report";
  int64_t first_step = 1, last_step = std::numeric_limits<int64_t>::max();
  if (!steps.empty() && !ParseSteps(steps, &first_step, &last_step)) {
    std::fprintf(stderr,
                 "rp-report: --steps %s: expected A..B with 1 <= A <= B (for example 3..5)\n",
                 steps.c_str());
    return rp::kExitBadConfig;
  }

  // metrics.jsonl: the run's steps so far (a torn last line of a run in progress is skipped).
  std::string text;
  std::vector<nlohmann::json> lines;
  if (!ReadText(dir + "/metrics.jsonl", &text)) {
    std::fprintf(stderr,
                 "rp-report: cannot read %s/metrics.jsonl (is %s a run's output directory?)\n",
                 dir.c_str(), dir.c_str());
    return rp::kExitBadConfig;
  }
  {
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer())
        lines.push_back(std::move(j));
    }
  }
  auto series_of = [&lines](const char* field, const char* name, const char* colour, bool markers) {
    Series s{name, colour, {}, markers};
    for (const auto& l : lines)
      if (l.contains(field) && l[field].is_number())
        s.points.emplace_back(l["step"].get<double>(), l[field].get<double>());
    return s;
  };
  const Series eval = series_of("eval_loss", "eval loss", "#e07b24", true);
  std::vector<Series> loss_series = {series_of("loss", "training loss", "#3b6fb6", false)};
  if (!eval.points.empty()) loss_series.push_back(eval);
  std::vector<Picture> charts = {
      {"loss.svg", Chart("loss", "Loss", "mean token cross-entropy (nats)", loss_series)},
      {"lr.svg",
       Chart("lr", "Learning rate", "learning rate", {series_of("lr", "lr", "#7a4fb3", false)})},
      {"grad_norm.svg", Chart("grad_norm", "Gradient norm", "global L2 norm (before clipping)",
                              {series_of("grad_norm", "gradient norm", "#3c9a50", false)})},
      {"tokens_per_s.svg", Chart("tokens_per_s", "Throughput", "tokens/s",
                                 {series_of("tokens_per_s", "tokens/s", "#c0392b", false)})},
  };

  // trace.json: written when the run ends.
  std::optional<Timeline> timeline;
  std::string no_timeline;
  if (ReadText(dir + "/trace.json", &text)) {
    nlohmann::json trace = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (trace.is_discarded() || !trace.contains("traceEvents")) {
      std::fprintf(stderr, "rp-report: %s/trace.json is not a trace file\n", dir.c_str());
      return rp::kExitBadConfig;
    }
    timeline = DrawTimeline(trace, first_step, last_step, &no_timeline);
    if (!timeline && !steps.empty()) {
      std::fprintf(stderr, "rp-report: --steps %s: %s\n", steps.c_str(), no_timeline.c_str());
      return rp::kExitBadConfig;
    }
  } else {
    no_timeline = "trace.json is written when the run ends (or metrics.trace is off)";
  }

  // The summary: the job, its plan, the run's figures.
  std::string job_name = fs::path(dir).filename().string();
  const auto rows = SummaryRows(dir, lines, eval, &job_name);

  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) {
    std::fprintf(stderr, "rp-report: cannot create %s: %s\n", out.c_str(), ec.message().c_str());
    return rp::kExitError;
  }
  const std::string html = ReportHtml(job_name, rows, charts, timeline, no_timeline);
  std::vector<Picture> files = charts;
  if (timeline) files.push_back({"timeline.svg", timeline->svg});
  files.push_back({"report.html", html});
  for (const auto& f : files)
    if (auto s = rp::core::WriteFileAtomically(out + "/" + f.file, f.svg); !s.ok()) {
      std::fprintf(stderr, "rp-report: %s\n", s.message().c_str());
      return rp::kExitError;
    }
  std::printf("%s: %zu steps reported\n", dir.c_str(), lines.size());
  if (timeline) {
    std::printf("  timeline: %zu microbatches, %d workers, %.3f s\n", timeline->microbatches,
                timeline->workers, timeline->span);
    double total = 0;
    for (int w = 0; w < timeline->workers; ++w) {
      std::printf("  worker %d busy %.1f%%\n", w, 100.0 * timeline->busy[w] / timeline->span);
      total += timeline->busy[w];
    }
    std::printf("  bubble ratio over the window %.1f%%\n",
                100.0 * (1.0 - total / (timeline->span * timeline->workers)));
  } else {
    std::printf("  no timeline: %s\n", no_timeline.c_str());
  }
  std::printf("  wrote %s/report.html\n", out.c_str());
  return 0;
}
