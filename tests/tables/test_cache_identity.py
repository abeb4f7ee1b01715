"""A cache hit is checked against the request: an entry holding another model's table
under this key, its checksum updated to match, is discarded and rebuilt, never served. Tiny
two-layer Llamas, each cache in tmp_path."""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np
import pytest

from gap_engine.core.cachepaths import META_FILE, TABLE_FILE, entry_dir
from gap_engine.core.config import WindowSpec
from gap_engine.pipeline.stages import loss_table
from gap_engine.tables.artefact import TableSpec

pytestmark = pytest.mark.slow  # tiny models end to end: make test runs these, make test-fast does not

SPEC = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16, batch_size=2), estimator="fisher", rate_grid=(0.0, 0.5))


def forge(victim_key: str, table_text: str) -> None:
    """Put ``table_text`` (another entry's table.json) under ``victim_key``, key and checksum made to match."""
    data = json.loads(table_text)
    data["key"] = victim_key
    text = json.dumps(data, separators=(",", ":")) + "\n"
    folder = entry_dir(victim_key)
    (folder / TABLE_FILE).write_text(text)
    meta = json.loads((folder / META_FILE).read_text())
    meta["table_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (folder / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("other", ["weights", "geometry"])
def test_a_forged_entry_is_rebuilt_not_served(make_tiny, tmp_path, monkeypatch, caplog, other):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    lm = make_tiny("llama")
    foreign = make_tiny("llama", seed=1) if other == "weights" else make_tiny("llama", intermediate_size=128)
    mine, theirs = loss_table(lm, SPEC), loss_table(foreign, SPEC)
    assert mine.key != theirs.key
    forge(mine.key, (entry_dir(theirs.key) / TABLE_FILE).read_text())
    if other == "geometry":  # the same weights' fingerprint claimed: only the counts tell it is not this model's
        path = entry_dir(mine.key) / TABLE_FILE
        data = json.loads(path.read_text()) | {"model_fingerprint": lm.fingerprint}
        forge(mine.key, json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="gap_engine.tables.cache"):
        again = loss_table(lm, SPEC)
    assert "it is not the table asked for" in caplog.text
    assert again.model_fingerprint == lm.fingerprint
    np.testing.assert_array_equal(again.removed, mine.removed)
    np.testing.assert_allclose(again.delta, mine.delta)
    assert loss_table(lm, SPEC).build_seconds == again.build_seconds  # the rebuilt entry is a hit again
