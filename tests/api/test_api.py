"""docs/python-api.md runs as written: its code blocks, in order, on the real SmolLM2-135M (slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_doc_has_the_example():
    blocks = code_blocks(DOC.read_text())
    assert len(blocks) >= 2 and "api.front(" in blocks[0] and "api.save(" in blocks[0]


@pytest.mark.slow
def test_the_python_api_page_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in code_blocks(DOC.read_text()):
        exec(compile(block, str(DOC), "exec"), scope)  # the page's own code, as a reader runs it
    out = capsys.readouterr().out
    assert "(60, 16)" in out  # 30 layers x attention and MLP, 16 rates
    plan, pruned, lm = scope["plan"], scope["pruned"], scope["lm"]
    assert (plan.allocator, plan.criterion, plan.compensation) == ("dp", "obs", "none")  # SmolLM2's DP step, its own update
    assert pruned.result.plan.criterion == "obs" and pruned.result.compensation is None
    # 20% of the prunable parameters go (net of any biases): the shipped model is the plan's promise
    net = lm.param_count() - pruned.params
    assert net >= 0.2 * plan.params["dense_prunable"]
    assert (tmp_path / "runs" / "dp20" / "gap_pruned.json").is_file()
    report, uniform_ppl = scope["report"], scope["uniform"]
    assert set(report.perplexity) == {"wiki-sample", "news-sample"} and all(v > 0 for v in report.kl_to_dense.values())
    assert uniform_ppl.plan.allocator == "uniform" and uniform_ppl.plan.criterion == "wanda"  # the table's, with bias
