"""Benchmark of the budget planner in a real browser: budget change -> updated chart.

Starts ``streamlit run app.py`` on a loopback port with its own cache holding one loss
table of SmolLM2-135M (30 layers, 60 components, 8 rates; built here with the fast taylor
method on a few windows: the figure's size, not the table's accuracy, is what is timed),
opens the Budget planner in headless Chromium and drags the Plotly budget slider across
all of its steps, forwards and back, with the mouse button held.

Timed in the page (performance.now()):
- client step: from ``plotly_sliderchange`` (the slider moved to a new budget) to
  ``plotly_animated`` (the step's frame was applied: bars, uniform line, loss marker and
  readout redrawn), and to the next animation frame after it (the frame that shows it);
- for contrast, a server round trip: one press of the arrow key on the Streamlit
  "choose this budget" slider until the plan readouts under the chart changed.

    python bench/bench_app.py [--sweeps 2] [--server-steps 8] [--out bench/results/app.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_browser import CHROMIUM, CHROMIUM_ARGS, link_models, start_app, stop_app  # noqa: E402

TARGET_MS = 100.0
BENCH_SPEC = dict(data="wiki-sample", n_samples=2, seq_len=32, estimator="taylor", rate_grid=tuple(i / 8 for i in range(8)))

INSTALL_JS = """() => {
  const gd = [...document.querySelectorAll('.js-plotly-plot')]
      .find(g => g.layout && g.layout.sliders && g.layout.sliders.length);
  const bench = window.__gapBench = {records: [], pending: null};
  gd.on('plotly_sliderchange', () => { bench.pending = {change: performance.now()}; });
  gd.on('plotly_animated', () => {
    const rec = bench.pending; bench.pending = null;
    if (!rec) return;
    rec.update = performance.now();
    requestAnimationFrame(() => { rec.frame = performance.now(); bench.records.push(rec); });
  });
  return gd.layout.sliders[0].steps.length;
}"""


def build_table(cache_dir: Path) -> str:
    os.environ["GAP_CACHE_DIR"] = str(cache_dir)
    from gap_engine.models import load_model
    from gap_engine.pipeline import loss_table
    from gap_engine.tables import TableSpec

    table = loss_table(load_model("smollm2-135m"), TableSpec.from_dict(BENCH_SPEC))
    return table.key


def two_frames(page) -> None:
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def client_steps(page, sweeps: int) -> list[dict]:
    """Drag the Plotly slider over every step, ``sweeps`` times (forwards, back, ...)."""
    n_steps = page.evaluate(INSTALL_JS)
    grip = page.locator(".js-plotly-plot .slider-grip-rect").bounding_box()
    rail = page.locator(".js-plotly-plot .slider-rail-touch-rect").bounding_box()
    y = grip["y"] + grip["height"] / 2
    page.mouse.move(grip["x"] + grip["width"] / 2, y)
    page.mouse.down()
    # The slider spans the rail minus a small inset each side; overshoot both ends a little.
    xs = [rail["x"] + rail["width"] * i / (n_steps - 1) for i in range(n_steps)]
    for sweep in range(sweeps):
        path = xs if sweep % 2 == 0 else xs[::-1]
        for x in path:
            page.mouse.move(x, y)
            two_frames(page)
    page.mouse.up()
    page.wait_for_timeout(300)
    return page.evaluate("() => window.__gapBench.records")


def server_steps(page, steps: int) -> list[float]:
    """Press ArrowRight on the Streamlit budget slider; time until the plan readouts changed."""
    thumb = page.get_by_role("slider").first
    thumb.scroll_into_view_if_needed()
    read_metric = "() => document.querySelector('[data-testid=\"stMetricValue\"]').textContent"
    times = []
    for _ in range(steps):
        before = page.evaluate(read_metric)
        thumb.focus()
        started = time.perf_counter()
        page.keyboard.press("ArrowRight")
        page.wait_for_function(
            "(before) => { const m = document.querySelector('[data-testid=\"stMetricValue\"]');"
            " return m && m.textContent !== before; }",
            arg=before,
            timeout=30_000,
        )
        times.append((time.perf_counter() - started) * 1000)
        page.wait_for_timeout(500)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweeps", type=int, default=2, help="drags over all slider steps (alternating direction)")
    parser.add_argument("--server-steps", type=int, default=8, help="arrow-key presses on the server-side slider")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="gap-bench-app-") as tmp:
        cache_dir = Path(tmp) / "cache"
        link_models(cache_dir)
        key = build_table(cache_dir)
        process, url = start_app(cache_dir, Path(tmp) / "streamlit.log")
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{url}/planner")
                page.locator(".js-plotly-plot .slider-grip-rect").wait_for(timeout=180_000)
                page.wait_for_timeout(1500)
                records = client_steps(page, args.sweeps)
                server = server_steps(page, args.server_steps) if args.server_steps else []
                version = browser.version
                browser.close()
        finally:
            stop_app(process)

    to_update = [r["update"] - r["change"] for r in records]
    to_frame = [r["frame"] - r["change"] for r in records]
    met = statistics.median(to_frame) < TARGET_MS
    lines = [
        "## Budget slider: step -> updated chart (in the browser)",
        "",
        f"- table `{key}` (30 layers, 60 components x 8 rates), 101 slider steps",
        f"- Chromium {version} headless, Streamlit's bundled plotly.js; CPython {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        f"- {len(records)} slider steps timed ({args.sweeps} drags over every step, mouse button held)",
        "",
        "| from a budget step to | median ms | p90 ms | max ms |",
        "|---|---:|---:|---:|",
        f"| chart redrawn (`plotly_animated`) | {statistics.median(to_update):.1f} | {_p90(to_update):.1f} | {max(to_update):.1f} |",
        f"| next frame shown | {statistics.median(to_frame):.1f} | {_p90(to_frame):.1f} | {max(to_frame):.1f} |",
    ]
    if server:
        lines.append(
            f"| for contrast: server slider, one arrow key -> plan readouts updated (full rerun) | {statistics.median(server):.0f} | "
            f"{_p90(server):.0f} | {max(server):.0f} |"
        )
    lines += ["", f"- target median < {TARGET_MS:.0f} ms: {'met' if met else 'NOT met'} ({statistics.median(to_frame):.1f} ms to the next frame)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if met else 1


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


if __name__ == "__main__":
    sys.exit(main())
