"""In a real headless Chromium, on a phone-sized screen and offline: layout, colours, the report.

The app starts with a tiny real loss table already in its cache (SmolLM2-135M, taylor,
2 x 16 tokens, 4 rates). At 390 x 844 px (a phone) no two visible pieces of text on the
Budget planner overlap and its bars use the whole width; the Sensitivity heat map is drawn
with the colours its exported file has; every page is saved as a screenshot; and the
stakeholder report written by ``gap report`` opens from a file:// URL with no request.
"""

from __future__ import annotations

import pytest
from test_browser import (  # noqa: F401
    CHROMIUM,
    DOT_OFF_FRONT_JS,
    SCREENSHOTS,
    browser,
    go_to,
    link_models,
    open_report_offline,
    shot,
    start_app,
    stop_app,
)

from gap_engine.core.config import WindowSpec
from gap_engine.pipeline.stages import loss_table as build_table
from gap_engine.tables.artefact import TableSpec

pytestmark = pytest.mark.browser

PHONE = {"width": 390, "height": 844}
TINY_SPEC = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", rate_grid=(0.0, 0.25, 0.5, 0.75))

# Every visible piece of text: a rectangle per line of each text node (HTML and SVG), with
# where it sits. Text hidden by CSS, scrolled out of a scrolling box or of zero size is left out.
TEXT_BOXES_JS = """(rootSelector) => {
  const root = document.querySelector(rootSelector);
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const boxes = [];
  const visible = (el) => {
    for (let e = el; e && e !== document.body; e = e.parentElement) {
      const style = getComputedStyle(e);
      if (style.display === 'none' || style.visibility === 'hidden' || Number(style.opacity) === 0) return false;
    }
    return true;
  };
  let id = 0;
  while (walker.nextNode()) {
    const node = walker.currentNode;
    if (!node.textContent.trim()) continue;
    const el = node.parentElement;
    if (!el || !visible(el) || el.closest('[aria-hidden="true"], .hovertext, .modebar')) continue;
    const closed = el.closest('details:not([open])');  // a collapsed expander shows its summary only
    if (closed && !el.closest('summary')) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    const rects = el instanceof SVGElement ? [el.getBoundingClientRect()] : [...range.getClientRects()];
    id += 1;
    for (const r of rects) {
      if (r.width < 1 || r.height < 1) continue;
      boxes.push({id, text: node.textContent.trim().slice(0, 40), x: r.left, y: r.top + window.scrollY, w: r.width, h: r.height});
    }
  }
  return boxes;
}"""


def overlaps(boxes: list[dict], tolerance: float = 1.0) -> list[tuple]:
    """Pairs of text boxes (of different text nodes) that overlap by more than ``tolerance`` px both ways."""
    found = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if a["id"] == b["id"]:
                continue
            dx = min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"])
            dy = min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"])
            if dx > tolerance and dy > tolerance:
                found.append((a["text"], b["text"], round(dx, 1), round(dy, 1), round(a["x"]), round(a["y"])))
    return found


@pytest.fixture(scope="module")
def phone_server(tmp_path_factory, smol):
    cache_dir = tmp_path_factory.mktemp("browser-layout-cache")
    link_models(cache_dir)
    import os

    previous = os.environ.get("GAP_CACHE_DIR")
    os.environ["GAP_CACHE_DIR"] = str(cache_dir)
    try:
        table = build_table(smol, TINY_SPEC)  # into this cache: the app loads it at once
    finally:
        if previous is None:
            os.environ.pop("GAP_CACHE_DIR")
        else:
            os.environ["GAP_CACHE_DIR"] = previous
    process, url = start_app(cache_dir, cache_dir / "streamlit.log")
    try:
        yield {"url": url, "cache": cache_dir, "table": table, "log": cache_dir / "streamlit.log"}
    finally:
        stop_app(process)


@pytest.fixture
def phone(browser, phone_server):
    page = browser.new_page(viewport=PHONE)
    page.set_default_timeout(60_000)
    outside = []
    page.on(
        "request", lambda r: None if r.url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:")) else outside.append(r.url)
    )
    page.goto(phone_server["url"])
    page.get_by_role("heading", name="Setup").first.wait_for(timeout=120_000)
    yield page
    page.close()
    assert outside == [], outside


def open_page(page, title: str) -> None:
    """Open a page from the sidebar (collapsed on a phone).

    Streamlit collapses the sidebar a moment after the window turns narrow: checking once whether
    it is collapsed raced that (CI clicked a link that had just slid off the screen), so this
    waits until the link is on screen, expanding the sidebar whenever its button shows. The
    collapse can also come after the link was seen on screen and before the click lands (the
    window had just turned narrow): the click then finds the link slid away, and the whole
    wait-and-click is tried again."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    expand = page.locator('[data-testid="stExpandSidebarButton"]').first
    link = page.locator('[data-testid="stSidebarNav"] a', has_text=title).first
    for attempt in range(3):
        for _ in range(100):
            if expand.is_visible():
                expand.click()
            box = link.bounding_box() if link.is_visible() else None
            if box is not None and box["x"] >= 0 and box["x"] + box["width"] <= page.viewport_size["width"]:
                break
            page.wait_for_timeout(200)
        try:
            link.click(timeout=10_000)
            break
        except PlaywrightTimeoutError:
            if attempt == 2:
                raise
    page.get_by_role("heading", name=title).first.wait_for(timeout=60_000)
    collapse = page.locator('[data-testid="stSidebarCollapseButton"] button, button[data-testid="stSidebarCollapseButton"]').first
    if collapse.is_visible():
        collapse.click()
    page.wait_for_timeout(500)


def test_planner_on_a_phone_has_no_overlapping_text(phone, phone_server):
    open_page(phone, "Budget planner")
    phone.locator(".gap-budget-front .main-svg").first.wait_for(timeout=120_000)
    phone.wait_for_timeout(1500)
    boxes = phone.evaluate(TEXT_BOXES_JS, '[data-testid="stMain"]')
    assert len(boxes) > 40  # the readout, legend, captions, tick labels and metrics were all measured
    assert overlaps(boxes) == []
    # The two panels stack and each spans the column; the bars spread over every layer.
    rates = phone.locator(".gap-budget-rates").bounding_box()
    front = phone.locator(".gap-budget-front").bounding_box()
    assert front["y"] >= rates["y"] + rates["height"] - 1 and rates["width"] > 300
    axis = phone.evaluate(
        """() => { const gd = document.querySelector('.gap-budget-rates');
                   return {range: gd._fullLayout.xaxis.range, width: gd._fullLayout._size.w,
                           bars: [...gd.querySelectorAll('.bars .point')].length}; }"""
    )
    assert axis["range"][1] >= phone_server["table"].num_layers - 0.5  # every layer on the axis, not 0-9
    assert axis["width"] > 0.75 * rates["width"]  # the plot area takes the panel, not a squeezed corner
    assert phone.evaluate(DOT_OFF_FRONT_JS) < 1.5  # the chosen budget's point sits on the front's line, on a narrow plot too
    shot(phone, "phone-3-planner")


# Pieces of the page wider than the box that shows them: a table that scrolls sideways, a
# metric cut with an ellipsis, a static table clipped at the right.
CUT_OFF_JS = """() => {
  const wider = (selector) => [...document.querySelectorAll(selector)]
      .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => [e.textContent.slice(0, 40), e.scrollWidth, e.clientWidth]);
  return {tables: wider('[data-testid="stDataFrame"] .dvn-scroller'), metrics: wider('[data-testid="stMetric"] .stMarkdownEllipsis'),
          static: wider('[data-testid="stTable"], [data-testid="stTable"] > div'), main: wider('[data-testid="stMain"]'),
          count: document.querySelectorAll('[data-testid="stDataFrame"]').length};
}"""


def recovered_run(cache_dir, tokenizer, monkeypatch) -> int:
    """A real, tiny recovery in the app's cache (a two-layer Llama with the real tokenizer, pruned,
    two LoRA steps on the page's two default texts, the offline task on two examples, one
    generation); its history id. About 11 CPU-seconds, most of it tokenizing the two texts."""
    from conftest import tiny_lm

    from gap_engine.evaluate import history
    from gap_engine.evaluate.tasks import TaskSettings, prepare_tasks
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.loading import load_model
    from gap_engine.model.rateplan import make_plan
    from gap_engine.pipeline.recovery import RecoverySettings, app_output_dir, recover
    from gap_engine.pipeline.stages import prune_with_plan

    monkeypatch.setenv("GAP_CACHE_DIR", str(cache_dir))
    lm = tiny_lm("llama", tokenizer)
    plan = make_plan(lm, [0.5, 0.0], [0.25, 0.5], "wanda", allocator="dp", budget=0.2)
    pruned = prune_with_plan(lm, plan, WindowSpec(data="news-sample", n_samples=2, seq_len=32, batch_size=2))
    folder = history.new_checkpoint_dir("dp", 0.2)
    save_pruned(lm, plan, pruned.kept_indices(), folder)
    history.record_run(history.RunRecord(model=lm.name, allocator="dp", plan=plan.to_dict(), budget=0.2, checkpoint=str(folder)))
    settings = RecoverySettings(tasks=("wiki-sample", "news-sample"), steps=2, batch_size=1, seq_len=16, eval_samples=1,
                                eval_seq_len=16, eval_generations=1)  # fmt: skip
    result = recover(
        load_model(str(folder)), settings, out_dir=app_output_dir(folder, settings), lm_eval_tasks=prepare_tasks(TaskSettings(limit=2))
    )
    assert result.run_id is not None
    return result.run_id


@pytest.mark.heavy  # every page at phone width (~40 s); the planner on a phone stays in make test
def test_every_page_on_a_phone(phone, phone_server, smol, monkeypatch):
    for number, title in enumerate(("Setup", "Sensitivity", "Budget planner", "Prune & evaluate", "Export"), start=1):
        open_page(phone, title)
        phone.wait_for_timeout(1500)
        assert phone.locator('[data-testid="stException"]').count() == 0, title
        shot(phone, f"phone-{number}-{title.lower().replace(' & ', '-').replace(' ', '-')}")

    # Recover's finished result (opened from its link, as after a reload) whole on a phone
    # and at 1400 px: no table scrolls sideways, no metric is cut with an ellipsis.
    run_id = recovered_run(phone_server["cache"], smol.tokenizer, monkeypatch)
    for width, name in ((PHONE["width"], "phone-6-recover"), (1400, "desktop-recover")):
        phone.set_viewport_size({"width": width, "height": PHONE["height"]})
        phone.goto(f"{phone_server['url']}/recover?recovery={run_id}")
        phone.get_by_text("Recovered checkpoint:").first.wait_for(timeout=120_000)
        phone.locator('[data-testid="stDataFrame"] .dvn-scroller').nth(2).wait_for(timeout=60_000)  # two texts' results, one task
        phone.wait_for_timeout(1500)
        assert phone.locator('[data-testid="stException"]').count() == 0
        cut = phone.evaluate(CUT_OFF_JS)
        assert cut["count"] == 3 and cut["tables"] == cut["metrics"] == cut["static"] == cut["main"] == [], (width, cut)
        shot(phone, name)


def watch(page) -> dict:
    """What went wrong while ``page`` was open: responses with an error status, console errors
    (a failed resource load logs one too) and uncaught exceptions; filled in as they happen."""
    seen: dict = {"failed": [], "console": []}
    page.on("response", lambda r: seen["failed"].append((r.status, r.url)) if r.status >= 400 else None)
    page.on("console", lambda m: seen["console"].append(m.text[:200]) if m.type == "error" else None)
    page.on("pageerror", lambda e: seen["console"].append(str(e)[:200]))
    return seen


def test_a_sub_page_opens_and_reloads_with_no_failed_request(browser, phone_server):
    """Opened at its own address and reloaded (a shared link, F5), a page asks for nothing that
    fails: no ``/evaluate/_stcore/health`` or ``/evaluate/_stcore/host-config`` before ``/``
    (two 404s, two console errors)."""
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    page.set_default_timeout(120_000)
    seen = watch(page)
    try:
        page.goto(f"{phone_server['url']}/evaluate")
        page.get_by_role("heading", name="Prune & evaluate").first.wait_for()
        page.reload()
        page.get_by_role("heading", name="Prune & evaluate").first.wait_for()
        page.get_by_text("Held-out samples").first.wait_for()  # the page drew its form after the reload
        page.wait_for_timeout(1000)
        assert page.url.startswith(f"{phone_server['url']}/evaluate")
        assert seen == {"failed": [], "console": []}
    finally:
        page.close()


def test_heatmap_in_the_app_has_the_colours_of_its_export(phone):
    from gap_engine.views.figures.style import HEAT_SCALE

    open_page(phone, "Sensitivity")
    phone.locator(".js-plotly-plot").nth(1).wait_for(timeout=60_000)
    phone.wait_for_timeout(1000)
    drawn = phone.evaluate(
        """() => { const gd = [...document.querySelectorAll('.js-plotly-plot')].find(g => g._fullLayout.coloraxis);
                   return {scale: gd._fullLayout.coloraxis.colorscale, reversed: !!gd._fullLayout.coloraxis.reversescale}; }"""
    )
    assert drawn["reversed"] is False
    assert [[float(p), c.lower()] for p, c in drawn["scale"]] == [[float(p), c.lower()] for p, c in HEAT_SCALE]


def test_the_report_opens_from_a_file_with_no_request(browser, phone_server, tmp_path):
    from gap_engine.cli import main

    table_path = tmp_path / "table.json"
    table_path.write_text(phone_server["table"].to_json())
    out = tmp_path / "report.html"
    assert main(["report", "--table", str(table_path), "--budget", "0.3", "--out", str(out)]) == 0
    text = open_report_offline(browser, out, "report-from-cli")
    assert phone_server["table"].key in text and "Per-layer plan" in text


def test_predicted_vs_actual_fits_a_phone_with_its_toolbar_shown(browser, tmp_path):
    """On a phone the chart's x-axis title must not be clipped nor its legend covered by the
    toolbar. Drawn by plotly.js in Chromium at the width Streamlit gives a chart on a 390 px
    screen, toolbar forced on (a touch shows it): the axis titles lie inside the figure and the
    legend clear of the toolbar. No server: the figure's own HTML."""
    import pandas as pd

    from gap_engine.views.figures.run_figures import predicted_vs_actual_figure

    runs = pd.DataFrame({"id": [1, 2, 3], "allocator": ["dp", "uniform", "owl"], "budget": [0.2, 0.2, 0.3],
                         "predicted_loss": [0.52, 0.71, 0.9], "actual_loss": [0.77, 0.95, 1.2]})  # fmt: skip
    page = browser.new_page(viewport=PHONE)
    try:
        from pathlib import Path

        import plotly

        script = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").as_uri()  # plotly's own copy, read from disk
        html = predicted_vs_actual_figure(runs).to_html(include_plotlyjs=script, full_html=True, default_width="358px",
                                                         config={"displayModeBar": True})  # fmt: skip
        (tmp_path / "chart.html").write_text(html)
        page.goto((tmp_path / "chart.html").as_uri())
        page.locator(".modebar").first.wait_for(timeout=30_000)
        boxes = page.evaluate(
            """() => { const box = (s) => { const r = document.querySelector(s).getBoundingClientRect();
                                             return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
                       return {figure: box('.main-svg'), x: box('.g-xtitle'), y: box('.g-ytitle'), legend: box('.legend'),
                               toolbar: box('.modebar')}; }"""
        )
    finally:
        page.close()
    figure = boxes["figure"]
    for title in ("x", "y"):
        assert figure["left"] <= boxes[title]["left"] and boxes[title]["right"] <= figure["right"], (title, boxes)
        assert figure["top"] <= boxes[title]["top"] and boxes[title]["bottom"] <= figure["bottom"], (title, boxes)
    legend, toolbar = boxes["legend"], boxes["toolbar"]
    apart = (
        legend["right"] <= toolbar["left"]
        or toolbar["right"] <= legend["left"]
        or legend["bottom"] <= toolbar["top"]
        or toolbar["bottom"] <= legend["top"]
    )
    assert apart, boxes


DESKTOPS = ({"width": 1366, "height": 768}, {"width": 1920, "height": 1080})
PAGES = ("Setup", "Sensitivity", "Budget planner", "Prune & evaluate", "Recover", "Export")

# What does not fit on a desktop screen: the page scrolling sideways, a table or chart reaching past
# the column that holds it (a data frame may scroll inside itself), a static table wider than its box,
# a metric's label or caption cut with an ellipsis, and cells that read "None".
DESKTOP_FIT_JS = """() => {
  const main = document.querySelector('[data-testid="stMain"]');
  const column = document.querySelector('[data-testid="stMainBlockContainer"]').getBoundingClientRect();
  const text = (e) => e.textContent.trim().slice(0, 50);
  const wider = (selector) => [...document.querySelectorAll(selector)]
      .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1).map(e => [text(e), e.scrollWidth, e.clientWidth]);
  const past = [...document.querySelectorAll('[data-testid="stDataFrame"], [data-testid="stTable"], [data-testid="stPlotlyChart"]')]
      .filter(e => e.offsetParent !== null && e.getBoundingClientRect().right > column.right + 1)
      .map(e => [e.dataset.testid, text(e), Math.round(e.getBoundingClientRect().right), Math.round(column.right)]);
  const cells = [...document.querySelectorAll('[data-testid="stDataFrame"] [role="gridcell"], [data-testid="stTable"] td')];
  return {page: main.scrollWidth > main.clientWidth + 1 ? [main.scrollWidth, main.clientWidth] : null, past,
          static: wider('[data-testid="stTable"]'),
          metrics: wider('[data-testid="stMetricLabel"] .stMarkdownEllipsis, [data-testid="stMetricLabel"] p, [data-testid="stMetricValue"] div, [data-testid="stMetricDelta"] div'),
          none: cells.filter(c => c.textContent.trim() === 'None').length, cells: cells.length,
          frames: document.querySelectorAll('[data-testid="stDataFrame"]').length};
}"""


def measured_run(table, smol, cache_dir) -> int:
    """One real prune-and-evaluate of the tiny table's plan at 20% (2 held-out windows of 16 tokens,
    one 2-token generation) recorded in the app's history: Prune & evaluate then shows its result,
    the run history, its charts and the comparison."""
    from gap_engine.core.config import DEFAULT_COMPENSATION
    from gap_engine.evaluate import history
    from gap_engine.evaluate.metrics import EvalSettings
    from gap_engine.pipeline.runs import prune_and_evaluate
    from gap_engine.prune.compensations import CompensationSettings

    settings = EvalSettings(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), throughput=False, generations=1, max_new_tokens=2)
    run = prune_and_evaluate(smol, settings, table=table, budget=0.2, history_path=cache_dir / "runs" / history.HISTORY_FILE,
                             compensation=CompensationSettings(mode=DEFAULT_COMPENSATION))  # fmt: skip
    return int(run.run_id)


def test_every_page_fits_1366_and_1920_with_no_console_error(browser, phone_server, smol):
    """Every page at 1366 x 768 and at 1920 x 1080, every expander open, with a measured run in the
    history (opened from its link, so its result and the comparison show): nothing reaches past the
    page's column, no metric is cut, no cell reads "None", and the console stays empty (no
    "Resize must be passed a displayed plot div" from a chart drawn while hidden)."""
    run_id = measured_run(phone_server["table"], smol, phone_server["cache"])
    page = browser.new_page(viewport=DESKTOPS[0])
    page.set_default_timeout(120_000)
    seen = watch(page)
    found = {}
    try:
        page.goto(f"{phone_server['url']}/?run={run_id}&runs={run_id}")
        page.get_by_role("heading", name="Setup").first.wait_for()
        for title in PAGES:
            go_to(page, title)
            page.wait_for_function('() => !document.querySelector(\'[data-testid="stSpinner"], [data-testid="stSkeleton"]\')')
            if title == "Budget planner":
                page.locator(".gap-budget-front .main-svg").first.wait_for()
            if title == "Prune & evaluate":
                page.get_by_role("heading", name="Run history").wait_for()
            closed = page.locator('[data-testid="stMain"] details:not([open]) > summary')
            for _ in range(closed.count()):  # each click opens one: the next closed one is first
                closed.first.click()
                page.wait_for_timeout(200)
            for size in DESKTOPS:
                page.set_viewport_size(size)
                page.wait_for_timeout(1500)
                assert page.locator('[data-testid="stException"]').count() == 0, title
                fit = page.evaluate(DESKTOP_FIT_JS)
                found[(title, size["width"])] = fit
                shot(page, f"desktop-{size['width']}-{title.lower().replace(' & ', '-').replace(' ', '-')}", grow=False)
            page.set_viewport_size(DESKTOPS[0])
    finally:
        page.close()
    bad = {key: fit for key, fit in found.items() if fit["page"] or fit["past"] or fit["static"] or fit["metrics"] or fit["none"]}
    assert (bad, seen) == ({}, {"failed": [], "console": []})
    assert found[("Prune & evaluate", 1366)]["frames"] >= 1 and found[("Prune & evaluate", 1366)]["cells"] > 10  # the history was drawn
