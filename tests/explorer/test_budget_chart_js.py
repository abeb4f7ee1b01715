"""The budget chart's JavaScript talks to plotly.js through its public API only.

plotly.js's underscored state (``gd._fullLayout``, ``_size``, an axis's ``l2p``) changes between
releases without notice; the chart places its point from the figure's layout and the plot area's
box in the DOM instead. Read from the source (nothing runs): the chart's script and the keeper's,
which budget_chart.py holds as a string. Where the point lands is checked in a real browser
(tests/browser/test_browser.py and test_browser_layout.py, DOT_OFF_FRONT_JS).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

EXPLORER = Path(__file__).resolve().parents[2] / "explorer"
# plotly.js's private names: an underscored property, and the axis converters it keeps on them.
PRIVATE = re.compile(r"\._[A-Za-z]|\b(?:_fullLayout|_fullData|_size|l2p|p2l|d2p|p2d|c2p|l2c)\b")


def _chart_scripts() -> dict[str, str]:
    module = ast.parse((EXPLORER / "budget_chart.py").read_text())
    keeper = next(
        node.value.value
        for node in module.body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["KEEPER_JS"]
    )
    return {"budget_chart.js": (EXPLORER / "budget_chart.js").read_text(), "KEEPER_JS": keeper}


def test_the_budget_chart_uses_no_private_plotly_state():
    scripts = _chart_scripts()
    assert "placeDot" in scripts["budget_chart.js"] and "unsaved" in scripts["KEEPER_JS"]  # the scripts were found
    found = [
        f"{name}:{text[: m.start()].count(chr(10)) + 1}: {m.group()}" for name, text in scripts.items() for m in PRIVATE.finditer(text)
    ]
    assert found == []


def test_the_private_name_check_finds_what_the_chart_used_to_read():
    for read in ("layout._size.l", "const { _fullLayout } = gd", "xaxis.l2p(point[0])", "gd._fullData[0]"):
        assert PRIVATE.search(read), read
    assert not PRIVATE.findall("front.__gapDotHook = true; gd.layout.xaxis.range; drag.getBoundingClientRect();")
