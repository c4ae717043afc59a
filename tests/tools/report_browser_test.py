#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""rp-report's page in a real browser: trains the demo job (configs/tiny.toml, 2 CPU workers, with
an eval split), writes its report whole, zoomed to two steps and as of a run in progress (the
first steps of metrics.jsonl, no trace.json), renders each in headless
Chromium and checks the rendered page by DOM queries: no console errors; each chart with both
axes' tick labels and titles, grid lines and a legend; no two tick labels of an axis overlapping;
no text under 10 px; the timeline with one lane per worker plus the optimizer's, a boundary per
step of the window and a legend with every part. Also that the page fetches nothing.

    report_browser_test.py SOURCE_DIR BIN_DIR        (exit 77: no Chromium, skipped)
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

SOURCE, BIN = sys.argv[1], sys.argv[2]
WORKERS, STEPS = 2, 6

# Injected first into <head>: records script errors and console errors.
CAPTURE = """<script>
window.__rpErrors = [];
window.addEventListener('error', e => window.__rpErrors.push('error: ' + e.message));
const __rpConsoleError = console.error;
console.error = (...a) => { window.__rpErrors.push('console.error: ' + a.join(' ')); __rpConsoleError(...a); };
</script>"""

# Appended to <body>: the checks, written into the DOM as JSON.
CHECKS = """<script>
function overlaps(nodes) {
  const r = [...nodes].map(n => n.getBoundingClientRect());
  let n = 0;
  for (let i = 0; i < r.length; ++i)
    for (let j = i + 1; j < r.length; ++j)
      if (r[i].left < r[j].right && r[j].left < r[i].right && r[i].top < r[j].bottom && r[j].top < r[i].bottom) ++n;
  return n;
}
const out = {errors: window.__rpErrors, charts: [], timeline: null, minFont: 1e9, smallText: []};
for (const svg of document.querySelectorAll('svg.rp-chart')) {
  const xt = svg.querySelectorAll('g.x-axis text.tick-label'), yt = svg.querySelectorAll('g.y-axis text.tick-label');
  out.charts.push({id: svg.id, xTicks: xt.length, yTicks: yt.length,
                   axisTitles: [...svg.querySelectorAll('text.axis-title')].map(t => t.textContent),
                   grid: svg.querySelectorAll('line.grid').length,
                   legend: [...svg.querySelectorAll('g.legend text')].map(t => t.textContent),
                   overlaps: overlaps(xt) + overlaps(yt)});
}
const tl = document.querySelector('svg#timeline');
if (tl) {
  const ticks = tl.querySelectorAll('g.x-axis text.tick-label');
  out.timeline = {lanes: tl.querySelectorAll('g.lane').length,
                  workerLanes: tl.querySelectorAll('g.lane[data-worker]').length,
                  optimizerLanes: tl.querySelectorAll('g.lane[data-lane="optimizer"]').length,
                  boundaries: [...tl.querySelectorAll('line.step-boundary')].map(l => +l.dataset.step),
                  legend: [...tl.querySelectorAll('g.legend text')].map(t => t.textContent),
                  ticks: ticks.length, overlaps: overlaps(ticks),
                  stepLabelOverlaps: overlaps(tl.querySelectorAll('text.step-label')),
                  legendOverlaps: overlaps(tl.querySelectorAll('g.legend text'))};
}
for (const el of document.querySelectorAll('body *')) {
  if (!el.textContent.trim() || el.children.length || el.tagName === 'SCRIPT' || el.tagName === 'title') continue;
  const px = parseFloat(getComputedStyle(el).fontSize);
  if (px < out.minFont) out.minFont = px;
  if (px < 10) out.smallText.push(el.textContent.slice(0, 40));
}
const pre = document.createElement('pre');
pre.id = 'rp-check';
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    if r.returncode != 0:
        sys.exit(f"report_browser_test: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def render(chrome, page, tmp):
    """The page's DOM after its scripts ran, and the browser's log (console messages included)."""
    r = subprocess.run([chrome, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        f"--user-data-dir={tmp}/profile", "--virtual-time-budget=5000", "--window-size=1400,2000",
                        "--dump-dom", "file://" + page], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"report_browser_test: chromium failed on {page}:\n{r.stderr[-3000:]}")
    return r.stdout, r.stderr


def check(chrome, report_dir, tmp, want_steps, problems, timeline=True):
    page = os.path.join(report_dir, "report.html")
    html = open(page).read()
    # Self-contained: no scripts, styles or images from elsewhere, no script at all.
    for pattern in (r"<script", r"<link", r"<img", r"<iframe", r"url\(", r"https?://(?!www\.w3\.org/2000/svg)"):
        if re.search(pattern, html):
            problems.append(f"{page}: holds {pattern}")
    # The page as shipped: nothing the browser logs as a console message.
    _, log = render(chrome, page, tmp)
    console = [l for l in log.splitlines() if "CONSOLE" in l or "Uncaught" in l]
    if console:
        problems.append(f"{page}: console messages: {console[:3]}")
    checked = os.path.join(report_dir, "checked.html")
    with open(checked, "w") as f:
        f.write(html.replace("<head>", "<head>\n" + CAPTURE, 1).replace("</body>", CHECKS + "\n</body>", 1))
    dom, log = render(chrome, checked, tmp)
    m = re.search(r'<pre id="rp-check">(.*?)</pre>', dom, re.S)
    if not m:
        problems.append(f"{checked}: the checks did not run; browser log: {log[-2000:]}")
        return
    r = json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    where = os.path.basename(report_dir)
    if r["errors"]:
        problems.append(f"{where}: errors in the page: {r['errors']}")
    ids = sorted(c["id"] for c in r["charts"])
    if ids != ["grad_norm", "loss", "lr", "tokens_per_s"]:
        problems.append(f"{where}: charts {ids}")
    for c in r["charts"]:
        if c["xTicks"] < 2 or c["yTicks"] < 2:
            problems.append(f"{where}: chart {c['id']}: {c['xTicks']} x and {c['yTicks']} y tick labels")
        if len(c["axisTitles"]) != 2 or not all(t.strip() for t in c["axisTitles"]):
            problems.append(f"{where}: chart {c['id']}: axis titles {c['axisTitles']}")
        if c["grid"] < 4:
            problems.append(f"{where}: chart {c['id']}: {c['grid']} grid lines")
        if not c["legend"]:
            problems.append(f"{where}: chart {c['id']}: no legend")
        if c["overlaps"]:
            problems.append(f"{where}: chart {c['id']}: {c['overlaps']} overlapping tick labels")
    loss = next((c for c in r["charts"] if c["id"] == "loss"), None)
    if loss and sorted(loss["legend"]) != ["eval loss", "training loss"]:
        problems.append(f"{where}: the loss chart's legend is {loss['legend']}")
    if r["minFont"] < 10:
        problems.append(f"{where}: text of {r['minFont']} px: {r['smallText'][:5]}")
    t = r["timeline"]
    if not timeline:
        if t is not None or 'id="no-timeline"' not in html:
            problems.append(f"{where}: a run in progress should get the charts and say why there is no timeline")
        return
    if t is None:
        problems.append(f"{where}: no timeline")
        return
    if t["workerLanes"] != WORKERS or t["optimizerLanes"] != 1 or t["lanes"] != WORKERS + 1:
        problems.append(f"{where}: timeline lanes {t}")
    if sorted(t["boundaries"]) != want_steps:
        problems.append(f"{where}: step boundaries {t['boundaries']}, expected {want_steps}")
    legend = " | ".join(t["legend"])
    for part in ("forward", "backward", "recompute", "weight fetch", "gradient return", "optimizer update", "idle"):
        if part not in legend:
            problems.append(f"{where}: the timeline's legend ({legend}) lacks {part}")
    for key in ("overlaps", "stepLabelOverlaps", "legendOverlaps"):
        if t[key]:
            problems.append(f"{where}: timeline: {t[key]} {key}")
    if t["ticks"] < 2:
        problems.append(f"{where}: timeline: {t['ticks']} time ticks")


def main():
    chrome = browser()
    if chrome is None:
        print("report_browser_test: no Chromium found (Debian: apt-get install chromium); skipped")
        sys.exit(77)
    tmp = tempfile.mkdtemp(prefix="rp-report-browser-")
    run_dir = os.path.join(tmp, "run")
    run([os.path.join(BIN, "rp-launch"), "--gpus", str(WORKERS), os.path.join(SOURCE, "configs/tiny.toml"),
         "--set", f"job.output_dir={run_dir}", "--set", f"train.steps={STEPS}", "--set", "train.eval_every=2",
         "--set", "data.eval_fraction=0.1"])
    run([os.path.join(BIN, "rp-report"), run_dir, "--out", os.path.join(tmp, "whole")])
    run([os.path.join(BIN, "rp-report"), run_dir, "--out", os.path.join(tmp, "zoom"), "--steps", "2..3"])
    # A run in progress: metrics.jsonl so far (a torn last line included), no trace.json yet.
    partial = os.path.join(tmp, "partial")
    os.makedirs(partial)
    lines = open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()
    with open(os.path.join(partial, "metrics.jsonl"), "w") as f:
        f.write("\n".join(lines[:3]) + "\n" + lines[3][:20])
    run([os.path.join(BIN, "rp-report"), partial, "--out", os.path.join(tmp, "running")])
    problems = []
    check(chrome, os.path.join(tmp, "whole"), tmp, list(range(1, STEPS + 1)), problems)
    check(chrome, os.path.join(tmp, "zoom"), tmp, [2, 3], problems)
    check(chrome, os.path.join(tmp, "running"), tmp, [], problems, timeline=False)
    if problems:
        print("report_browser_test: " + "\n  ".join(problems))
        sys.exit(1)
    shutil.rmtree(tmp, ignore_errors=True)
    print("report_browser_test: the three pages render with every check met")


if __name__ == "__main__":
    main()
