"""End to end in a real headless Chromium: the user's path through all five pages.

Starts ``streamlit run serve.py`` (app.py) on a free loopback port with its own cache (the converted
built-in model is linked in), then: builds a tiny table through the Setup form, drags the
budget chart's slider with the mouse and reads the bars from the Plotly graph between
moves (before the button is released), releases it and follows that exact budget through
Prune & evaluate (the run prunes exactly the released row's parameters) and Export (the
plan file and the stakeholder report, opened from a file:// URL with no request), and
uploads a plan for another model. No request may leave the machine. Every page is saved
as a screenshot under artifacts/screenshots/.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"

# JS: how far the centre of the budget chart's point is from the DP front line plotly.js drew (the
# first trace's path, mapped to the screen by the SVG's own matrix), in CSS pixels.
DOT_OFF_FRONT_JS = """() => {
  const dot = document.querySelector('.gap-budget-dot').getBoundingClientRect();
  const [cx, cy] = [dot.left + dot.width / 2, dot.top + dot.height / 2];
  const line = document.querySelector('.gap-budget-front .scatterlayer .trace path.js-line');
  const matrix = line.getScreenCTM();
  const xy = (line.getAttribute('d').match(/-?[0-9.]+(?:e-?[0-9]+)?/g) || []).map(Number);
  let best = Infinity;
  for (let i = 0; i + 3 < xy.length; i += 2) {
    const a = new DOMPoint(xy[i], xy[i + 1]).matrixTransform(matrix);
    const b = new DOMPoint(xy[i + 2], xy[i + 3]).matrixTransform(matrix);
    const [dx, dy] = [b.x - a.x, b.y - a.y];
    const t = dx || dy ? Math.max(0, Math.min(1, ((cx - a.x) * dx + (cy - a.y) * dy) / (dx * dx + dy * dy))) : 0;
    best = Math.min(best, Math.hypot(a.x + t * dx - cx, a.y + t * dy - cy));
  }
  return best;
}"""
# JS: the budget chart (explorer/budget_chart.js): its bars' graph div, the step shown, the readout.
PLANNER_STATE_JS = (
    """() => {
  const root = document.querySelector('.gap-budget');
  const gd = root && root.querySelector('.gap-budget-rates');
  if (!gd || !gd.data) return null;
  const slider = root.querySelector('.gap-budget-slider');
  return {attn: Array.from(gd.data[0].y), mlp: Array.from(gd.data[1].y),
          step: Number(root.querySelector('.gap-budget-readout').dataset.step), row: Number(root.querySelector('.gap-budget-readout').dataset.row),
          value: root.querySelector('.gap-budget-value').textContent,
          dot: Number(root.querySelector('.gap-budget-dot').dataset.x),
          dot_off: ("""
    + DOT_OFF_FRONT_JS
    + """)(),
          removed: root.querySelector('[data-k="removed"]').textContent,
          readout: root.querySelector('.gap-budget-readout').textContent,
          slider: {value: Number(slider.value), min: Number(slider.min), max: Number(slider.max)},
          pending: root.classList.contains('gap-budget-pending')};
}"""
)
LOCAL = ("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:", "about:")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def link_models(cache_dir: Path) -> None:
    """Give a test cache the already-converted built-in models (converting again takes minutes)."""
    from gap_engine.core.fsutil import cache_root

    models = cache_root() / "models"
    cache_dir.mkdir(parents=True, exist_ok=True)
    if models.is_dir() and not (cache_dir / "models").exists():
        (cache_dir / "models").symlink_to(models, target_is_directory=True)


def start_app(cache_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`streamlit run serve.py` (app.py) on a free loopback port; returns (process, base url) once healthy."""
    port = free_port()
    env = dict(os.environ, GAP_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "streamlit", "run", "serve.py",
        "--server.port", str(port), "--server.address", "127.0.0.1", "--server.headless", "true",
        "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
        "--client.toolbarMode", "minimal",
    ]  # fmt: skip
    log = open(log_path, "w")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"streamlit exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read().strip() == b"ok":
                    return process, url
        except OSError:
            time.sleep(0.3)
    stop_app(process)
    raise RuntimeError(f"streamlit did not become healthy in 90 s:\n{log_path.read_text()[-3000:]}")


def stop_app(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@pytest.fixture(scope="module")
def app_server(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("browser-cache")
    link_models(cache_dir)
    log_path = cache_dir / "streamlit.log"
    process, url = start_app(cache_dir, log_path)
    try:
        yield {"url": url, "cache": cache_dir, "log": log_path}
    finally:
        stop_app(process)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: run scripts/ensure_chromium.sh (make test does)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def shot(page, name: str, grow: bool = True) -> None:
    """Screenshot of the whole page: Streamlit scrolls inside its main area, so grow the viewport to it."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(400)
    if not grow:
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"))
        return
    size = page.viewport_size
    height = page.evaluate("() => (document.querySelector('[data-testid=\"stMain\"]') || document.body).scrollHeight")
    page.set_viewport_size({"width": size["width"], "height": int(min(max(height, size["height"]), 6000))})
    page.wait_for_timeout(600)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    page.set_viewport_size(size)
    page.wait_for_timeout(300)


def open_report_offline(browser, path: Path, screenshot: str) -> str:
    """Open a report from its file:// URL with every other request recorded and refused;
    returns its text once plotly.js has drawn its charts."""
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    requests = []
    context.route(
        "**/*",
        lambda route: route.continue_() if route.request.url.startswith("file://") else (requests.append(route.request.url), route.abort()),
    )
    context.on(
        "request", lambda request: requests.append(request.url) if not request.url.startswith(("file://", "data:", "blob:")) else None
    )
    page = context.new_page()
    try:
        page.goto(path.resolve().as_uri())
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4", timeout=60_000)
        page.wait_for_timeout(500)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{screenshot}.png"), full_page=True)
        assert requests == [], requests
        return page.content()
    finally:
        context.close()


def go_to(page, title: str) -> None:
    page.locator('[data-testid="stSidebarNav"] a', has_text=title).click()
    page.get_by_role("heading", name=title).first.wait_for(timeout=60_000)


def set_number(page, label: str, value) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(str(value))
    box.press("Enter")
    page.wait_for_timeout(300)


def removed_count(text: str) -> int:
    """The parameter count in the readout's "removes 41,181,312 parameters (...)"."""
    return int(text.split()[1].replace(",", ""))


def drag_budget(page, fractions) -> list[dict]:
    """Press the budget chart's thumb and move across ``fractions`` of the rail, reading the
    chart after each move; the button stays down (see `release_budget`)."""
    slider = page.locator(".gap-budget-slider")
    box = slider.bounding_box()
    state = page.evaluate(PLANNER_STATE_JS)
    at = (state["slider"]["value"] - state["slider"]["min"]) / (state["slider"]["max"] - state["slider"]["min"])
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + 8 + (box["width"] - 16) * at, y)  # the thumb (8 px inset each side)
    page.mouse.down()
    seen = []
    for fraction in fractions:
        page.mouse.move(box["x"] + box["width"] * fraction, y, steps=4)
        page.wait_for_timeout(120)
        seen.append(page.evaluate(PLANNER_STATE_JS))
    return seen


def release_budget(page, fraction: float) -> dict:
    """Move the pressed thumb to ``fraction`` of the rail and release it; the chart's state then."""
    box = page.locator(".gap-budget-slider").bounding_box()
    page.mouse.move(box["x"] + box["width"] * fraction, box["y"] + box["height"] / 2, steps=3)
    page.wait_for_timeout(120)
    page.mouse.up()
    # The readout draws asynchronously (a Plotly animation per step): under load it can still show
    # an earlier step, even the budget before the drag, whose plan the URL already names. Wait
    # until it shows the released step, which the thumb sits on.
    page.wait_for_function(
        """() => { const root = document.querySelector('.gap-budget');
                   const value = parseFloat(root.querySelector('.gap-budget-value').textContent);
                   return Math.abs(value - Number(root.querySelector('.gap-budget-slider').value)) < 0.006; }""",
        timeout=60_000,
    )
    return page.evaluate(PLANNER_STATE_JS)


def test_user_path(app_server, browser, smol, tmp_path):
    from gap_engine.model.rateplan import RatePlan

    page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page.set_default_timeout(30_000)
    outside = []
    page.on("request", lambda request: None if request.url.startswith(LOCAL) else outside.append(request.url))
    try:
        _user_path(page, app_server, smol, tmp_path, RatePlan)
        assert outside == [], outside  # no favicon, font or metrics request leaves the machine
    except BaseException:
        shot(page, "failure", grow=False)
        print("---- streamlit log ----\n" + app_server["log"].read_text()[-4000:])
        raise
    finally:
        page.close()


def _user_path(page, app_server, smol, tmp_path, RatePlan):
    started = time.monotonic()

    def phase(name: str) -> None:
        print(f"[browser] {name}: {time.monotonic() - started:.1f} s", flush=True)

    page.goto(app_server["url"])
    page.get_by_role("heading", name="Setup").first.wait_for(timeout=60_000)
    phase("page loaded")

    # ---- Setup: tiny settings through the form, then build --------------------------------
    # Finding 3 of the demo walkthrough: "Estimate time and memory" measured this machine for
    # ~16 s with nothing on screen. A fresh cache has no measured speed, so the click calibrates.
    page.get_by_role("button", name="Estimate time and memory").click()
    page.locator('[data-testid="stSpinner"]', has_text="Measuring this machine's speed").wait_for(timeout=30_000)
    page.get_by_text("predicted fisher table of smollm2-135m", exact=False).first.wait_for(timeout=120_000)
    phase("estimate shown after a spinner")
    page.get_by_text("taylor — fast: first-order", exact=False).click()
    set_number(page, "Calibration samples", 2)
    set_number(page, "Tokens per sample", 32)
    grid = page.get_by_label("Rate grid (comma-separated, starting at 0)")
    grid.fill("0, 0.25, 0.5, 0.75")
    grid.press("Enter")
    page.wait_for_timeout(500)
    phase("form filled")
    page.get_by_role("button", name="Build table").click()
    # the job runs in the background: a progress bar with a Cancel button, the page stays live
    page.locator('[data-testid="stProgress"]', has_text="Building the loss table").first.wait_for(timeout=30_000)
    # one Cancel for the build in the page (the sidebar lists every tab's running jobs with its own)
    assert page.locator('[data-testid="stMain"]').get_by_role("button", name="Cancel").count() == 1
    shot(page, "1-setup-building", grow=False)
    page.get_by_text("Loss table ready", exact=False).wait_for(timeout=240_000)
    page.get_by_text("60 components x 4 rates", exact=False).wait_for()  # 30 layers x (attn, mlp) by 4 rates
    shot(page, "1-setup")
    phase("setup")

    # ---- Sensitivity -----------------------------------------------------------------------
    go_to(page, "Sensitivity")
    page.locator(".js-plotly-plot").nth(1).wait_for(timeout=60_000)
    shot(page, "2-sensitivity")
    phase("sensitivity")

    # ---- Budget planner: drag the chart's slider, read the bars between moves, release ------
    go_to(page, "Budget planner")
    page.locator(".gap-budget-rates .main-svg").first.wait_for(timeout=120_000)
    page.wait_for_timeout(1000)
    before = page.evaluate(PLANNER_STATE_JS)
    assert before is not None and float(before["value"].rstrip("%")) >= 20.0  # the first row removing 20%
    during = drag_budget(page, (0.3, 0.4, 0.5, 0.6))
    shot(page, "3-planner-dragging", grow=False)
    steps = [s["step"] for s in during]
    assert steps == sorted(steps) and steps[-1] > before["step"], steps
    assert len({json.dumps([s["attn"], s["mlp"]]) for s in during}) >= 3, "the bars did not follow the pointer"
    assert sum(during[-1]["attn"]) + sum(during[-1]["mlp"]) > sum(before["attn"]) + sum(before["mlp"])
    assert len({s["readout"] for s in during}) >= 3  # the readout follows the slider too
    assert all(abs(s["dot"] - float(s["value"].rstrip("%"))) < 0.005 for s in during)  # and the point on the front
    assert all(s["dot_off"] < 1.5 for s in during), [s["dot_off"] for s in during]  # drawn on the front's line
    assert not any(s["pending"] for s in during)  # nothing went to the server while the button was down
    released = release_budget(page, 0.45)
    removed = removed_count(released["removed"])
    # The page reruns with that row: the numbers below the chart are the chart's, to the parameter.
    page.wait_for_function(
        "(n) => [...document.querySelectorAll('[data-testid=\"stMetricValue\"]')].some(m => m.textContent === n)",
        arg=f"{removed:,}",
        timeout=60_000,
    )
    page.wait_for_function("() => !document.querySelector('.gap-budget').classList.contains('gap-budget-pending')")
    after = page.evaluate(PLANNER_STATE_JS)
    assert (after["step"], after["value"], after["removed"]) == (released["step"], released["value"], released["removed"])
    assert abs(after["slider"]["value"] - float(after["value"].rstrip("%"))) < 0.005  # the thumb sits on the row's budget
    budget_text = released["value"]  # "38.83%"
    page.mouse.move(10, 10)
    shot(page, "3-planner")
    phase("planner")

    # ---- Prune & evaluate with tiny settings ------------------------------------------------
    go_to(page, "Prune & evaluate")
    page.get_by_text(f"removes {removed:,} parameters", exact=False).wait_for()
    assert page.locator('[data-testid="stMetricValue"]').first.text_content() == budget_text
    set_number(page, "Held-out samples", 2)
    set_number(page, "Tokens per sample", 32)
    set_number(page, "Generations", 1)
    set_number(page, "New tokens per generation", 4)
    page.get_by_text("Time throughput").click()
    page.get_by_text("Task accuracy (lm-eval)", exact=True).first.click()  # task accuracy has its own AppTest (test_app)
    page.wait_for_timeout(500)
    page.get_by_role("button", name="Prune and evaluate").click()
    page.get_by_text("Run 1 finished", exact=False).wait_for(timeout=300_000)
    page.get_by_text("Greedy generations").wait_for()
    page.get_by_role("heading", name="Run history").wait_for()
    from gap_engine.evaluate import history

    (record,) = history.runs(app_server["cache"] / "runs" / history.HISTORY_FILE)
    assert record.plan["params"]["removed"] == removed  # it pruned exactly the released row
    # SmolLM2's DP step by default: OBS, whose update is its compensation, so no bias is added and the model lost what the row removes.
    assert record.plan["criterion"] == "obs" and (record.params.get("compensation") or {}).get("bias_params", 0) == 0
    assert record.dense_params - record.pruned_params == removed
    assert f"{record.budget:.2%}" == budget_text
    cell = page.locator('[data-testid="stTable"] td', has_text=record.generations[0]["model"].strip()[:10]).first
    assert cell.evaluate("td => td.scrollWidth <= td.clientWidth + 1")  # generated text wraps, nothing cut off
    shot(page, "4-evaluate")
    phase("evaluate")

    # ---- Export: download the plan and check it against the model ---------------------------
    go_to(page, "Export")
    with page.expect_download() as download:
        page.get_by_role("button", name="Plan (JSON)").click()
    plan_text = Path(download.value.path()).read_text()
    plan = RatePlan.from_text(plan_text)
    plan.check_model(smol)
    assert plan.allocator == "dp" and plan.num_layers == smol.num_layers
    assert plan.params["removed"] == removed and f"{plan.budget:.2%}" == budget_text  # the released budget
    with page.expect_download() as download:
        page.get_by_role("button", name="Run history (CSV)").click()
    assert "predicted_loss" in Path(download.value.path()).read_text().splitlines()[0]
    page.wait_for_timeout(1500)  # the rerun after the last download settles
    with page.expect_download(timeout=120_000) as download:
        page.get_by_role("button", name="Download report (HTML)").click()
    report_path = tmp_path / "report.html"
    download.value.save_as(report_path)
    text = open_report_offline(page.context.browser, report_path, "5-report")
    assert f"{removed:,}" in text and budget_text in text and "Evaluation" in text

    # a plan made for another model is refused with a clear message
    foreign = json.loads(plan_text) | {"model": "some-other-model", "model_fingerprint": "0123456789abcdef"}
    foreign_path = tmp_path / "foreign-plan.json"
    foreign_path.write_text(json.dumps(foreign))
    page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(foreign_path))
    page.get_by_text("This plan does not fit the current model", exact=False).wait_for(timeout=60_000)
    assert page.locator('[data-testid="stException"]').count() == 0
    shot(page, "5-export")
    phase("export")
