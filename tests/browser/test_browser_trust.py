"""In a real headless Chromium: what a presenter relies on in a demo.

One plan: arrow keys pressed as fast as Playwright presses them on the budget slider, then at
once Prune & evaluate (the keys' budget is sent once they stop, so the page switch comes first):
that page shows the slider's budget, and the run prunes the plan whose hash the page shows.
Jobs and runs belong to the browser that made them: the presenter's link, opened in a second
browser context while a build runs, shows the build and the run without Cancel or Delete; the
presenter's reload still cancels the build; deleting the run asks first, says its checkpoint
goes too, and the run leaves the page at once. The app's cache holds the tiny real table of
tests/browser/test_browser_layout.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_browser import browser, go_to, set_number, shot  # noqa: F401
from test_browser_layout import phone_server  # noqa: F401

from explorer import ownership

pytestmark = pytest.mark.browser

CHART_JS = "() => document.querySelector('.gap-budget').parentElement.__gapBudgetChart"
SETTLED_JS = f"""() => {{ const c = ({CHART_JS})(); return c && c.data && c.sent == null && c.keyTimer == null
                       && c.shown === c.data.active && !c.ui.root.classList.contains('gap-budget-pending'); }}"""
KEYS = 20
READ_ONLY = "Started in another browser: read-only here."  # explorer.job_panel.READ_ONLY_JOB


def metric_value(page, label: str) -> str:
    return page.locator('[data-testid="stMetric"]', has_text=label).locator('[data-testid="stMetricValue"]').first.inner_text()


def shown_hash(page, pattern: str) -> str:
    """The plan hash in the first text on the page matching ``pattern`` (with a (?P<hash>) group)."""
    text = page.locator('[data-testid="stMain"]').inner_text()
    return re.search(pattern, text).group("hash")


@pytest.fixture(scope="module")
def presenter(browser):
    """The presenter's browser (its own cookies, so its own token)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    yield context
    context.close()


@pytest.fixture(scope="module")
def keyboard_run(presenter, phone_server):
    """Arrow keys at full speed, the page switch at once, then Prune & evaluate: what each page showed."""
    page = presenter.new_page()
    page.set_default_timeout(120_000)
    seen = {}
    try:
        page.goto(phone_server["url"])
        page.get_by_role("heading", name="Setup").first.wait_for()
        go_to(page, "Budget planner")
        page.locator(".gap-budget-front .main-svg").first.wait_for()
        page.wait_for_function(SETTLED_JS)
        budgets = page.evaluate(f"() => ({CHART_JS})().data.budgets")
        start = page.evaluate(f"() => ({CHART_JS})().data.active")
        page.locator(".gap-budget-slider").focus()
        for _ in range(KEYS):
            page.keyboard.press("ArrowRight")
        seen["slider"] = page.evaluate("() => Number(document.querySelector('.gap-budget-slider').value)")
        seen["keyed"] = budgets[start + KEYS]
        go_to(page, "Prune & evaluate")  # before the keys' release timer: the budget is not sent yet
        seen["first_shown"] = metric_value(page, "Budget from the planner")
        wanted = f"{seen['keyed']:.2%}"
        for _ in range(600):  # the page catches up (one rerun) or, before the keeper, never did
            if metric_value(page, "Budget from the planner") == wanted:
                break
            page.wait_for_timeout(100)
        seen["shown"] = metric_value(page, "Budget from the planner")
        set_number(page, "Held-out samples", 2)
        set_number(page, "Tokens per sample", 32)
        set_number(page, "Generations", 1)
        set_number(page, "New tokens per generation", 4)
        page.get_by_text("Time throughput").click()
        page.get_by_text("Task accuracy (lm-eval)", exact=True).first.click()
        page.wait_for_timeout(1000)
        seen["shown_hash"] = shown_hash(page, r"The planner's DP plan (?P<hash>[0-9a-f]{12})")
        seen["shown_at_click"] = metric_value(page, "Budget from the planner")
        page.get_by_role("button", name="Prune and evaluate").click()
        finished = page.get_by_text(re.compile(r"Run \d+ finished in .* \(plan [0-9a-f]{12}\)")).first
        finished.wait_for(timeout=400_000)
        message = finished.inner_text()
        seen["run_id"] = int(re.search(r"Run (\d+) finished", message).group(1))
        seen["run_hash"] = re.search(r"\(plan ([0-9a-f]{12})\)", message).group(1)
        shot(page, "trust-1-pruned-after-fast-keys")
        go_to(page, "Budget planner")
        page.locator(".gap-budget-front .main-svg").first.wait_for()
        page.wait_for_function(SETTLED_JS)
        seen["planner_hash"] = shown_hash(page, r"Plan (?P<hash>[0-9a-f]{12}) \(its content hash\)")
        seen["planner_budget"] = page.evaluate(f"() => {{ const c = ({CHART_JS})(); return c.data.budgets[c.data.active]; }}")
    except BaseException:
        shot(page, "trust-failure", grow=False)
        print("---- streamlit log ----\n" + phone_server["log"].read_text()[-4000:])
        raise
    finally:
        page.close()
    return seen


def test_fast_arrow_keys_then_prune_prunes_the_plan_on_screen(keyboard_run, phone_server):
    from gap_engine.evaluate import history

    seen = keyboard_run
    assert seen["slider"] == pytest.approx(seen["keyed"] * 100)  # every key press moved the slider one row
    assert seen["shown"] == f"{seen['keyed']:.2%}", seen  # Prune & evaluate shows the slider's budget ...
    assert seen["shown_at_click"] == seen["shown"]
    assert seen["run_hash"] == seen["shown_hash"], seen  # ... and prunes the plan whose hash it shows
    record = history.get_run(seen["run_id"], phone_server["cache"] / "runs" / history.HISTORY_FILE)
    assert record.params["plan_hash"] == seen["shown_hash"] and record.budget == seen["keyed"]
    assert seen["planner_hash"] == seen["run_hash"] and seen["planner_budget"] == seen["keyed"]  # back on the planner: the same plan
    print(
        f"\nkeys: the page switched at {seen['first_shown']}, then showed {seen['shown']}; run {seen['run_id']} pruned {seen['run_hash']}"
    )


def test_a_shared_link_is_read_only_and_the_sender_cancels_and_deletes_after_a_question(keyboard_run, presenter, browser, phone_server):
    from gap_engine.evaluate import history

    run_id = keyboard_run["run_id"]
    db = phone_server["cache"] / "runs" / history.HISTORY_FILE
    checkpoint = Path(history.get_run(run_id, db).checkpoint)
    assert checkpoint.is_dir()
    page = presenter.new_page()
    page.set_default_timeout(120_000)
    viewer = browser.new_context(viewport={"width": 1400, "height": 1000})
    other = viewer.new_page()
    other.set_default_timeout(120_000)
    try:
        # The presenter starts a build long enough to look at (cancelled below).
        page.goto(phone_server["url"])
        page.get_by_role("heading", name="Setup").first.wait_for()
        set_number(page, "Calibration samples", 64)
        set_number(page, "Tokens per sample", 256)
        page.wait_for_timeout(500)
        page.get_by_role("button", name="Build table").click()
        page.locator('[data-testid="stMain"] [data-testid="stProgress"]', has_text="Building the loss table").wait_for()
        page.wait_for_function("() => location.search.includes('jobs=')")
        link = page.url

        # The link in another browser: the build and the run, with no Cancel and no Delete.
        other.goto(link)
        other.get_by_role("heading", name="Setup").first.wait_for()
        other.locator('[data-testid="stMain"] [data-testid="stProgress"]', has_text="Building the loss table").wait_for()
        other.locator('[data-testid="stSidebar"]').get_by_text("Running jobs (all tabs)").wait_for()
        cancel = other.get_by_role("button", name=re.compile("Cancel"))
        other.get_by_text(READ_ONLY).first.or_(cancel.first).first.wait_for()  # the job's controls are drawn
        assert cancel.count() == 0
        assert other.get_by_text(READ_ONLY).count() == 2  # the page's panel and the sidebar say why
        shot(other, "trust-2-shared-link-read-only", grow=False)
        token = next(c["value"] for c in presenter.cookies() if c["name"] == ownership.COOKIE)
        assert token not in link and ownership.COOKIE not in link  # the proof of ownership never travels in a link
        go_to(other, "Prune & evaluate")
        other.get_by_role("heading", name="Run history").wait_for()
        other.get_by_text("were made in another browser: only that browser can delete them").wait_for()
        assert other.get_by_role("button", name=re.compile("Delete")).count() == 0

        # The presenter's reload gets the build back with its Cancel.
        page.reload()
        page.get_by_role("heading", name="Setup").first.wait_for()
        page.locator(".st-key-app_cancel_table button").click()
        page.get_by_text("was cancelled").wait_for()

        # Deleting the run asks first, names the checkpoint, and the run leaves the page at once.
        page.goto(f"{phone_server['url']}/evaluate?run={run_id}")  # its result panel, as a link to it shows it
        page.get_by_role("heading", name="Prune & evaluate").first.wait_for()
        page.get_by_role("heading", name=re.compile(rf"^Run {run_id}:")).wait_for()
        page.get_by_role("button", name="Delete run…").click()
        question = page.get_by_text(f"Delete run {run_id}? This deletes").first
        question.wait_for()
        assert str(checkpoint) in question.inner_text() and checkpoint.is_dir()
        assert [r.id for r in history.runs(db)] == [run_id]  # asked; nothing deleted yet
        shot(page, "trust-3-delete-asks", grow=False)
        page.get_by_role("button", name=f"Delete run {run_id} and its checkpoint").click()
        page.get_by_text(f"Deleted run {run_id} and its checkpoint.").wait_for()
        assert page.get_by_role("heading", name=re.compile(rf"^Run {run_id}:")).count() == 0
        assert history.runs(db) == [] and not checkpoint.exists()
        page.wait_for_function("() => !new URLSearchParams(location.search).has('run')")
    except BaseException:
        shot(page, "trust-failure-sender", grow=False)
        shot(other, "trust-failure-viewer", grow=False)
        print("---- streamlit log ----\n" + phone_server["log"].read_text()[-4000:])
        raise
    finally:
        page.close()
        viewer.close()


def test_keys_pressed_while_a_budget_is_being_set_all_count(presenter, phone_server):
    """Keys a little slower than the release delay: each one lands while the previous release is on
    its way, and the data of that older release does not pull the thumb back (every key counts)."""
    page = presenter.new_page()
    page.set_default_timeout(120_000)
    try:
        page.goto(f"{phone_server['url']}/planner")
        page.locator(".gap-budget-front .main-svg").first.wait_for()
        page.wait_for_function(SETTLED_JS)
        start = page.evaluate(f"() => ({CHART_JS})().data.active")
        page.locator(".gap-budget-slider").focus()
        for _ in range(6):
            page.keyboard.press("ArrowLeft")
            page.wait_for_timeout(450)  # past the 400 ms after which keys are sent
        page.wait_for_function(  # the last release is back from the server
            f"""() => {{ const c = ({CHART_JS})(); return c.sent == null && c.shown === c.data.active
                         && !c.ui.root.classList.contains('gap-budget-pending'); }}"""
        )
        end = page.evaluate(f"() => {{ const c = ({CHART_JS})(); return [c.data.active, c.data.budgets[c.data.active]]; }}")
        assert end[0] == start - 6, (start, end)
        page.wait_for_function("(b) => Math.abs(parseFloat(new URLSearchParams(location.search).get('budget')) - b) < 1e-12", arg=end[1])
    finally:
        page.close()


def test_a_step_the_planner_did_not_send_reaches_the_next_page(presenter, phone_server):
    """The chart keeps the step it shows in the tab's sessionStorage until the server has it; the
    keeper on the next page hands it over (here written directly, as a page switch before the keys'
    release timer leaves it), so that page shows the slider's budget, not the one before."""
    page = presenter.new_page()
    page.set_default_timeout(120_000)
    try:
        page.goto(f"{phone_server['url']}/planner")
        page.locator(".gap-budget-front .main-svg").first.wait_for()
        page.wait_for_function(SETTLED_JS)
        step, budget = page.evaluate(
            f"""() => {{ const c = ({CHART_JS})(), d = c.data, s = d.active + 7;
                  sessionStorage.setItem('gap-budget-unsaved', JSON.stringify({{front_id: d.front_id, step: s, row: d.rows[s],
                      removed: d.removed[s], budget: d.budgets[s], id: 'written-by-the-test'}}));
                  return [s, d.budgets[s]]; }}"""
        )
        go_to(page, "Export")
        page.get_by_text(f"budget {budget:.2%} of prunable parameters").first.wait_for()  # Export offers the slider's plan
        page.wait_for_function("(b) => parseFloat(new URLSearchParams(location.search).get('budget')) === b", arg=budget)
        assert page.evaluate("() => sessionStorage.getItem('gap-budget-unsaved')") is None  # handed over, then dropped
    finally:
        page.close()
