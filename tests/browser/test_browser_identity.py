"""In a real headless Chromium: one released plan through a reload and into the exported files.

A budget released on the planner (mouse drag) shows a plan hash; Prune & evaluate shows the
same hash and predicted loss after the browser reloads the page; Export offers that plan
under a file name with its budget and hash (and its report under one that says it is the
planner's, not a run's), and the exported planner chart opens at that budget. The same pages are photographed at 1400 px and at 390 px. The app's cache holds
the tiny real table of tests/browser/test_browser_layout.py.
"""

from __future__ import annotations

import re

import pytest
from test_browser import browser, drag_budget, go_to, release_budget, shot  # noqa: F401
from test_browser_layout import open_page, phone_server  # noqa: F401

pytestmark = pytest.mark.browser


def test_the_released_plan_survives_a_reload_into_the_exports(browser, phone_server, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page.set_default_timeout(60_000)
    try:
        page.goto(phone_server["url"])
        page.get_by_role("heading", name="Setup").first.wait_for(timeout=120_000)
        go_to(page, "Budget planner")
        page.locator(".gap-budget-front .main-svg").first.wait_for(timeout=120_000)
        drag_budget(page, [0.5])
        state = release_budget(page, 0.45)
        budget = state["value"]  # e.g. "30.12%"
        page.wait_for_function(  # the release reached the server: the URL names the released budget and its plan
            """(pct) => { const q = new URLSearchParams(location.search);
                         return /^[0-9a-f]{12}$/.test(q.get('plan') || '') && Math.abs(parseFloat(q.get('budget')) * 100 - pct) < 0.005; }""",
            arg=float(budget.rstrip("%")),
            timeout=60_000,
        )
        digest = re.search(r"plan=([0-9a-f]{12})", page.url).group(1)
        page.get_by_text(f"Plan {digest}").first.wait_for()

        go_to(page, "Prune & evaluate")
        page.wait_for_function("(d) => location.search.includes('plan=' + d)", arg=digest)  # the page wrote its view back
        page.reload()  # a new session: only the URL remembers the plan
        page.get_by_role("heading", name="Prune & evaluate").first.wait_for(timeout=120_000)
        caption = page.get_by_text(f"The planner's DP plan {digest}").first
        caption.wait_for()
        assert "predicted" in caption.inner_text()
        page.locator('[data-testid="stMetricValue"]', has_text=budget).first.wait_for()  # the budget the plan was released at
        shot(page, "identity-1400-evaluate-after-reload")

        go_to(page, "Export")
        page.get_by_text(f"Plan {digest} · budget {budget}").first.wait_for()
        with page.expect_download() as download:
            page.get_by_role("button", name="Plan (JSON)").click()
        assert download.value.suggested_filename == f"plan-dp-{budget.rstrip('%')}pct-{digest}.json"
        with page.expect_download(timeout=120_000) as download:  # the planner's report: never a run's report's name
            page.get_by_role("button", name="Download report (HTML)").click()
        assert download.value.suggested_filename == f"gap-report-planner-plan-dp-{budget.rstrip('%')}pct-{digest}.html"
        with page.expect_download() as download:
            page.get_by_role("button", name="planner (HTML)").click()
        html = tmp_path / "planner.html"
        download.value.save_as(html)
        chart = browser.new_page(viewport={"width": 1400, "height": 900})
        chart.goto(html.as_uri())
        chart.wait_for_function("() => document.querySelector('.slider-container') !== null", timeout=60_000)
        shown = chart.evaluate(
            "() => [...document.querySelectorAll('svg text')].map(t => t.textContent).join(' | ')"
        )  # drawn, not the JSON
        chart.close()
        assert f"Released plan {digest}: budget {budget}" in shown and f"Budget: {budget}" in shown, shown
        shot(page, "identity-1400-export")

        page.set_viewport_size({"width": 390, "height": 844})
        for title in ("Prune & evaluate", "Export"):
            open_page(page, title)
            if title == "Export":
                page.get_by_role("button", name="planner (HTML)").wait_for()  # the charts are drawn last
            page.wait_for_timeout(1000)
            assert page.locator('[data-testid="stException"]').count() == 0, title
            shot(page, f"identity-390-{title.lower().replace(' & ', '-')}")
        widest = page.evaluate(
            "() => Math.max(...[...document.querySelectorAll('[data-testid=\"stMain\"] button')].map(b => b.getBoundingClientRect().right))"
        )
        assert widest <= 390, widest  # no button runs off a phone's screen
    except BaseException:
        shot(page, "identity-failure", grow=False)
        raise
    finally:
        page.close()
