"""Fixtures of the command-line tests that prune a tiny model: ``gap`` run in-process with a cache of its own,
a tiny random two-layer Llama folder (8 query heads in 2 KV groups, MLP 128) with the real SmolLM2 tokenizer,
its calibration options (4 x 64 tokens) and the check of a one-line refusal."""

from __future__ import annotations

import pytest
from inprocess_cli import run_gap

WIDE = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
CALIB = ["--samples", "4", "--seq-len", "64", "--batch-size", "2"]


@pytest.fixture
def gap(capsys, tmp_path, monkeypatch):
    """Run ``gap`` in-process with a cache of its own: (exit status, stderr lines, stdout)."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GAP_FORCE_SIZE", raising=False)

    def run(*argv) -> tuple[int, list[str], str]:
        return run_gap(capsys, *argv)

    return run


@pytest.fixture
def tiny(make_tiny, tmp_path):
    lm = make_tiny("llama", **WIDE)
    folder = tmp_path / "tiny"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return folder


def refused(result, message: str) -> str:
    """The last stderr line of a run refused in one line (exit 2), which says ``message``."""
    code, err, _ = result
    assert code == 2 and err and err[-1].startswith(("gap: error: ", "gap prune: error: ")), (code, err)
    assert message.lower() in err[-1].lower(), err[-1]
    return err[-1]
