"""Benchmark of the budget planner in a real browser: budget step -> updated chart.

Starts ``streamlit run app.py`` on a loopback port with its own cache holding one loss
table of SmolLM2-135M (30 layers, 60 components, 8 rates; built here with the fast taylor
method on a few windows: the figure's size, not the table's accuracy, is what is timed),
opens the Budget planner in headless Chromium and drags the budget chart's slider
(explorer/budget_chart.js) across the rail, forwards and back, with the mouse button held.

Timed in the page (performance.now()):
- client step: from the slider's ``input`` event (the pointer moved it; read in the
  capture phase, before the chart's own handler) to the chart's ``gap-budget-drawn`` event
  (that step's bars, uniform line, front marker and readout applied), and to the next
  animation frame after it (the frame that shows it);
- for contrast, a server round trip: release the slider one step further and wait until
  the plan readouts under the chart (a full rerun of the page) changed.

    python bench/bench_app.py [--sweeps 2] [--positions 101] [--server-steps 8] [--out bench/results/app.md]
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
sys.path.insert(0, str(ROOT / "tests" / "browser"))  # test_browser: the app server and Chromium helpers

from report import command_line, machine_line, script_argv, write_result
from test_browser import CHROMIUM, CHROMIUM_ARGS, link_models, start_app, stop_app

from gap_engine.plan.front_view import MAX_STEPS

SCRIPT = "bench/bench_app.py"
TARGET_MS = 100.0
BENCH_SPEC = dict(data="wiki-sample", n_samples=2, seq_len=32, estimator="taylor", rate_grid=tuple(i / 8 for i in range(8)))

INSTALL_JS = """() => {
  const root = document.querySelector('.gap-budget');
  const bench = window.__gapBench = {records: [], pending: null};
  root.addEventListener('input', () => { bench.pending = {change: performance.now()}; }, true);
  root.addEventListener('gap-budget-drawn', () => {
    const rec = bench.pending; bench.pending = null;
    if (!rec) return;
    rec.update = performance.now();
    requestAnimationFrame(() => { rec.frame = performance.now(); bench.records.push(rec); });
  });
  return root.querySelector('.gap-budget-rates').data.length;
}"""
# The previous design, for a side-by-side ratio: one Plotly figure whose own slider steps are
# zero-duration animation frames (the engine's planner_figure, as Export writes it).
PLOTLY_SLIDER_JS = """() => {
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
READ_METRIC = "() => document.querySelector('[data-testid=\"stMetricValue\"]').textContent"


def build_table(cache_dir: Path) -> str:
    os.environ["GAP_CACHE_DIR"] = str(cache_dir)
    from gap_engine.model.loading import load_model
    from gap_engine.pipeline.stages import loss_table
    from gap_engine.tables.artefact import TableSpec

    table = loss_table(load_model("smollm2-135m"), TableSpec.from_dict(BENCH_SPEC))
    return table.key


def two_frames(page) -> None:
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def client_steps(page, sweeps: int, positions: int) -> list[dict]:
    """Drag the chart's slider over ``positions`` even points of its rail, ``sweeps`` times (forwards, back, ...)."""
    page.evaluate(INSTALL_JS)
    rail = page.locator(".gap-budget-slider").bounding_box()
    y = rail["y"] + rail["height"] / 2
    xs = [rail["x"] + 8 + (rail["width"] - 16) * i / (positions - 1) for i in range(positions)]  # 8 px thumb inset
    page.mouse.move(xs[0], y)
    page.mouse.down()
    for sweep in range(sweeps):
        path = xs if sweep % 2 == 0 else xs[::-1]
        for x in path:
            page.mouse.move(x, y)
            two_frames(page)
    page.mouse.up()  # one release at the end: one rerun, after the timed moves
    page.wait_for_timeout(300)
    return page.evaluate("() => window.__gapBench.records")


def plotly_slider_steps(page, sweeps: int) -> list[dict]:
    """Drag a Plotly figure's own slider over every step, ``sweeps`` times (the previous design)."""
    n_steps = page.evaluate(PLOTLY_SLIDER_JS)
    grip = page.locator(".js-plotly-plot .slider-grip-rect").bounding_box()
    rail = page.locator(".js-plotly-plot .slider-rail-touch-rect").bounding_box()
    y = grip["y"] + grip["height"] / 2
    page.mouse.move(grip["x"] + grip["width"] / 2, y)
    page.mouse.down()
    xs = [rail["x"] + rail["width"] * i / (n_steps - 1) for i in range(n_steps)]
    for sweep in range(sweeps):
        path = xs if sweep % 2 == 0 else xs[::-1]
        for x in path:
            page.mouse.move(x, y)
            two_frames(page)
    page.mouse.up()
    page.wait_for_timeout(300)
    return page.evaluate("() => window.__gapBench.records")


def exported_planner(cache_dir: Path, key: str, path: Path) -> Path:
    """The same front as the engine's planner figure with its own Plotly slider, in an HTML file."""
    from gap_engine.plan.front import dp_front, front_rows
    from gap_engine.tables import cache
    from gap_engine.views.figures.front_figures import planner_figure

    table = cache.get_table(key)
    rows = front_rows(table, dp_front(table))
    path.write_text(planner_figure(table, rows, None, active_budget=0.2).to_html(include_plotlyjs=True, full_html=True))
    return path


def server_steps(page, steps: int) -> list[float]:
    """Release the slider a little further each time; time until the plan readouts changed."""
    times = []
    for _ in range(steps):
        page.wait_for_function("() => !document.querySelector('.gap-budget').classList.contains('gap-budget-pending')")
        before = page.evaluate(READ_METRIC)
        rail = page.locator(".gap-budget-slider").bounding_box()
        state = page.evaluate(
            "() => { const s = document.querySelector('.gap-budget-slider'); return [Number(s.value), Number(s.min), Number(s.max)]; }"
        )
        at = (state[0] - state[1]) / (state[2] - state[1])
        y = rail["y"] + rail["height"] / 2
        page.mouse.move(rail["x"] + 8 + (rail["width"] - 16) * at, y)
        page.mouse.down()
        page.mouse.move(rail["x"] + 8 + (rail["width"] - 16) * min(1.0, at + 0.02), y, steps=2)
        started = time.perf_counter()
        page.mouse.up()
        page.wait_for_function(
            "(before) => { const m = document.querySelector('[data-testid=\"stMetricValue\"]'); return m && m.textContent !== before; }",
            arg=before,
            timeout=30_000,
        )
        times.append((time.perf_counter() - started) * 1000)
        page.wait_for_timeout(500)
    return times


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweeps", type=int, default=2, help="drags over the slider's rail (alternating direction)")
    parser.add_argument("--positions", type=int, default=101, help="pointer positions per drag, evenly over the rail")
    parser.add_argument("--server-steps", type=int, default=8, help="releases, each one step further (a full rerun each)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    load_start, started = os.getloadavg(), time.perf_counter()

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
                page.locator(".gap-budget-rates .main-svg").first.wait_for(timeout=180_000)
                page.wait_for_timeout(1500)
                load_before = os.getloadavg()
                records = client_steps(page, args.sweeps, args.positions)
                server = server_steps(page, args.server_steps) if args.server_steps else []
                figure_page = browser.new_page(viewport={"width": 1400, "height": 1000})
                figure_page.goto(exported_planner(cache_dir, key, Path(tmp) / "planner.html").as_uri())
                figure_page.locator(".js-plotly-plot .slider-grip-rect").wait_for(timeout=60_000)
                figure_page.wait_for_timeout(1000)
                previous = plotly_slider_steps(figure_page, args.sweeps)
                version = browser.version
                browser.close()
        finally:
            stop_app(process)

    to_update = [r["update"] - r["change"] for r in records]
    to_frame = [r["frame"] - r["change"] for r in records]
    met = statistics.median(to_frame) < TARGET_MS
    lines = [
        "# App benchmark: budget step -> updated chart",
        "",
        f"Command (from the repository root; needs `{CHROMIUM}`, see `scripts/ensure_chromium.sh`): `{command_line(SCRIPT, argv)}`",
        "",
        "It builds one loss table of SmolLM2-135M in a temporary cache (taylor, 2 x 32 tokens, rates 0, 1/8 ... 7/8: "
        "30 layers, 60 components x 8 rates, the size of the default table), starts `streamlit run app.py`, opens the "
        "Budget planner in headless Chromium and drags the budget chart's slider (`explorer/budget_chart.js`) over "
        f"{args.positions} even positions of its rail, forwards and back, with the mouse button held. In the page, "
        "`performance.now()` is read at the slider's `input` event (capture phase, before the chart's handler), at the "
        "chart's `gap-budget-drawn` event (that step's bars and uniform line restyled, the point on the front moved, the "
        "readout rewritten) and at the next animation frame. In the same run and browser it then drags the previous "
        "design, one Plotly figure whose own slider steps are zero-duration animation frames (the engine's "
        f"`planner_figure`, as Export writes it), for a side-by-side ratio. Target: median < {TARGET_MS:.0f} ms.",
        "",
        machine_line(load_start, started),
        "",
        "## Budget slider: step -> updated chart (in the browser)",
        "",
        f"- table `{key}` (30 layers, 60 components x 8 rates); the chart's slider has one step per front row "
        f"(at most {MAX_STEPS}), dragged over {args.positions} even pointer positions",
        f"- Chromium {version} headless, plotly.js {plotly_js_version()} from the plotly package; CPython {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, load average "
        + " ".join(f"{x:.2f}" for x in load_before)
        + " before the drags, "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + " after",
        f"- {len(records)} slider steps timed ({args.sweeps} drags over the rail, mouse button held)",
        "",
        "| from a budget step to | median ms | p90 ms | max ms |",
        "|---|---:|---:|---:|",
        f"| chart redrawn (`gap-budget-drawn`: bars, uniform line, marker, readout) | {statistics.median(to_update):.1f} | {_p90(to_update):.1f} | {max(to_update):.1f} |",
        f"| next frame shown | {statistics.median(to_frame):.1f} | {_p90(to_frame):.1f} | {max(to_frame):.1f} |",
    ]
    before_frame = [r["frame"] - r["change"] for r in previous]
    lines.append(
        f"| side by side, the previous design (one Plotly figure, its own slider, animation frames; {len(previous)} steps): "
        f"next frame shown | {statistics.median(before_frame):.1f} | {_p90(before_frame):.1f} | {max(before_frame):.1f} |"
    )
    if server:
        lines.append(
            f"| for contrast: release one step further -> plan readouts updated (full rerun) | {statistics.median(server):.0f} | "
            f"{_p90(server):.0f} | {max(server):.0f} |"
        )
    lines += [
        "",
        f"- target median < {TARGET_MS:.0f} ms: {'met' if met else 'NOT met'} ({statistics.median(to_frame):.1f} ms to the next frame)",
        f"- budget chart / previous design, median to the next frame: {statistics.median(to_frame) / statistics.median(before_frame):.2f}x",
    ]
    if args.out:
        write_result(args.out, lines, SCRIPT, argv)
    else:
        print("\n".join(lines))
    return 0 if met else 1


def plotly_js_version() -> str:
    from plotly.offline import get_plotlyjs_version

    return get_plotlyjs_version()


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


if __name__ == "__main__":
    sys.exit(main())
