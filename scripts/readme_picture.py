"""The README's picture: the Budget planner on the default model's default table, in headless Chromium.

    PYTHONPATH=. .venv/bin/python scripts/readme_picture.py [--cache DIR] [--out docs/explorer.png]

Builds (or reads from the cache) the table the explorer's Setup page builds by default for the
default model (fisher estimate of KL to dense on 16 x 256 tokens of wiki-sample, rates in
eighths; about 2 minutes on two cores), serves the explorer on a free loopback port with that
cache, opens the planner at the default budget in a 1400 x 1000 window and saves the window
down to the metrics under the chart. Needs Chromium at /usr/bin/chromium (`make browser-deps`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "browser"))  # test_browser: the app server the browser tests start

from test_browser import CHROMIUM, CHROMIUM_ARGS, start_app, stop_app

VIEWPORT = {"width": 1400, "height": 1000}


def default_table(cache_dir: Path):
    """The explorer's default table of the default model, built into ``cache_dir`` unless it is there."""
    os.environ["GAP_CACHE_DIR"] = str(cache_dir)
    from gap_engine.core.config import APP_TABLE, DEFAULT_MODEL
    from gap_engine.model.loading import load_model
    from gap_engine.pipeline.stages import loss_table
    from gap_engine.tables.artefact import TableSpec

    spec = TableSpec(windows=APP_TABLE.windows, estimator=APP_TABLE.estimator, objective=APP_TABLE.objective, rate_grid=APP_TABLE.rate_grid)
    return loss_table(load_model(DEFAULT_MODEL), spec)


def photograph(url: str, table_key: str, out: Path) -> None:
    """The planner at the default budget as the window shows it, written to ``out`` (temp file, then renamed)."""
    from playwright.sync_api import sync_playwright

    from gap_engine.core.config import DEFAULT_BUDGET

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(300_000)
            page.goto(f"{url}/planner?table={table_key}&budget={DEFAULT_BUDGET!r}")
            page.locator(".gap-budget-front .main-svg").first.wait_for()
            page.locator('[data-testid="stMetricValue"]').first.wait_for()
            page.wait_for_function("() => !document.querySelector('[data-testid=\"stSpinner\"]')")
            page.mouse.move(5, VIEWPORT["height"] - 5)  # no hover label on the chart
            page.wait_for_timeout(1500)
            # Down to the metrics under the chart: no line of text cut at the bottom edge.
            bottom = page.evaluate(
                "() => Math.max(...[...document.querySelectorAll('[data-testid=\"stMetric\"]')].map(m => m.getBoundingClientRect().bottom))"
            )
            clip = {"x": 0, "y": 0, "width": VIEWPORT["width"], "height": min(VIEWPORT["height"], int(bottom) + 10)}
            with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.stem}-", suffix=".png", delete=False) as tmp:
                page.screenshot(path=tmp.name, clip=clip)
            os.chmod(tmp.name, 0o644)  # a temporary file is private; the picture is not
            os.replace(tmp.name, out)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None, help="the cache the table is built into or read from (default: the project's)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "explorer.png", help="where the picture goes")
    args = parser.parse_args(argv)
    if not Path(CHROMIUM).is_file():
        print(f"{CHROMIUM} is missing: run `make browser-deps`", file=sys.stderr)
        return 2
    from gap_engine.core.fsutil import cache_root

    cache_dir = (args.cache or cache_root()).resolve()
    table = default_table(cache_dir)
    print(f"table {table.key}", flush=True)
    process, url = start_app(cache_dir, cache_dir / "readme_picture.log")
    try:
        photograph(url, table.key, args.out.resolve())
    finally:
        stop_app(process)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
