"""In a real headless Chromium: a build survives a reload, shows its stage and ETA from the start,
is seen from a second tab, and stops within the calibration batch it was in when cancelled.

One `streamlit run app.py` with a fresh cache (the converted built-in model linked in). The
first build (fisher, 4 x 128 tokens, rates 0 and 0.5) is reloaded while it runs and finishes into the reloaded
page. The second build (the form's defaults: fisher, 8 x 128 tokens, two calibration batches)
then shows its predicted time before Build, a stage and the time left before its first batch ends, and is cancelled during
its first calibration batch. Seconds from Cancel to the "cancelled" message are printed.
"""

from __future__ import annotations

import re
import time

import pytest
from playwright.sync_api import expect
from test_browser import app_server, browser, set_number, shot  # noqa: F401

pytestmark = pytest.mark.browser

PROGRESS = '[data-testid="stMain"] [data-testid="stProgress"]'


def progress_text(page) -> str:
    texts = page.locator(PROGRESS).all_inner_texts()
    return texts[0] if texts else ""


def wait_text(page, predicate, timeout: float, step_ms: int = 100) -> str:
    """Poll the main progress bar's text until ``predicate(text)``; returns that text."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = progress_text(page)
        if predicate(text):
            return text
        page.wait_for_timeout(step_ms)
    raise AssertionError(f"progress never matched; last: {text!r}")


def test_a_build_survives_a_reload_shows_its_stage_and_eta_and_cancels_within_a_batch(app_server, browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(120_000)
    page.goto(app_server["url"])
    page.get_by_role("heading", name="Setup").first.wait_for()

    # ---- a first build, reloaded while it runs, finishes into the reloaded page ----
    set_number(page, "Calibration samples", 4)  # one calibration batch of 4 x 128 tokens
    page.get_by_label("Rate grid (comma-separated, starting at 0)").fill("0, 0.5")
    page.get_by_label("Rate grid (comma-separated, starting at 0)").press("Enter")
    page.wait_for_timeout(500)
    page.get_by_role("button", name="Build table").click()
    first = wait_text(page, lambda t: "stage " in t, 30)
    assert "Building the loss table: stage 1 of 4, load model" in first or "stage 2 of 4" in first, first
    page.wait_for_function("() => location.search.includes('jobs=')", timeout=30_000)
    page.reload()
    page.get_by_role("heading", name="Setup").first.wait_for()
    after_reload = wait_text(page, lambda t: "Building the loss table: stage" in t, 30)
    # The running job's settings fill the form. Under load the reloaded page can first draw the
    # number box at its widget minimum (1) for one frame before the session's value arrives (seen in
    # CI and reproduced with two busy loops), so wait for the value rather than read it once.
    expect(page.get_by_label("Calibration samples")).to_have_value("4", timeout=10_000)
    shot(page, "jobs-1-reloaded-during-a-build")
    page.get_by_text("Loss table ready in").wait_for(timeout=300_000)
    ready = page.get_by_text("Loss table ready in").inner_text()
    assert "load model" in ready and "gradient pass" in ready, ready  # every stage's time, the load included
    page.wait_for_function("() => location.search.includes('table=') && !location.search.includes('jobs=')", timeout=30_000)

    # ---- the defaults: the expected time before Build, then a stage and ETA from the start ----
    set_number(page, "Calibration samples", 8)
    # Wait for the rerun with 8 samples: until it arrives the page still shows the caption of the
    # settings just built, which is a cache hit ("cached here: Build reads it": no gradient pass).
    # The build that just finished taught the cost model this machine's speed: the caption says so.
    learned = re.compile(r"Predicted time \(learned from \d+ runs? on this machine\): about")
    caption = page.get_by_text(learned).filter(has_text="gradient pass")
    caption.wait_for(timeout=30_000)
    expected = caption.inner_text()
    assert "cached here" not in expected, expected
    page.get_by_role("button", name="Build table").click()
    clicked = time.monotonic()
    with_eta = wait_text(page, lambda t: " left" in t, 60, step_ms=50)
    eta_after = time.monotonic() - clicked
    assert re.search(r"stage \d of 4, (load model|read text|score units|gradient pass)", with_eta), with_eta
    assert not re.search(r"gradient pass: [1-9]", with_eta), with_eta  # before the first batch ended
    shot(page, "jobs-2-stage-and-eta")

    # A second tab with no link lists the running build in its sidebar.
    other = context.new_page()
    other.goto(app_server["url"])
    sidebar = other.locator('[data-testid="stSidebar"]')
    sidebar.get_by_text("Running jobs (all tabs)").wait_for(timeout=60_000)
    sidebar.get_by_text("Loss table build, fisher table of smollm2-135m").wait_for(timeout=60_000)
    sidebar.get_by_role("button", name="Watch").wait_for(timeout=30_000)

    # Cancel during the first calibration batch.
    wait_text(page, lambda t: "gradient pass" in t, 240, step_ms=50)
    page.locator(".st-key-app_cancel_table button").click()
    pressed = time.monotonic()
    cancelling = False
    while time.monotonic() - pressed < 60:
        if "Cancelling" in page.locator(".st-key-app_cancel_table").all_inner_texts().__str__():
            cancelling = True
        if page.get_by_text("was cancelled").count():
            break
        page.wait_for_timeout(50)
    cancelled_after = time.monotonic() - pressed
    message = page.get_by_text("was cancelled").inner_text()
    assert "during gradient pass" in message, message
    server_latency = float(re.search(r"stopped ([0-9.]+) s after the request", message).group(1))
    shot(page, "jobs-3-cancelled")
    print(
        f"\nbrowser: ETA shown {eta_after:.1f} s after Build ({with_eta!r}); reloaded page showed {after_reload!r}; "
        f"'Cancelling' seen: {cancelling}; Cancel -> 'cancelled' on the page {cancelled_after:.1f} s, "
        f"job stopped {server_latency:.1f} s after the request"
    )
    context.close()
