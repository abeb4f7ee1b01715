"""Text sources named inside a file never reach the network.

A loss table's spec is read back as a ``StoredWindowSpec``: equal to the spec it was built for,
kept through ``replace``, and read by the data layer from local files and caches only.
"""

from __future__ import annotations

import dataclasses

import pytest

from gap_engine.core.config import StoredWindowSpec, WindowSpec
from gap_engine.core.errors import DataError
from gap_engine.data.windows import may_fetch, read_corpus


def test_a_stored_spec_equals_the_typed_one_and_keeps_its_origin_through_replace():
    typed = WindowSpec("wiki-sample", n_samples=2, seq_len=16)
    stored = StoredWindowSpec("wiki-sample", n_samples=2, seq_len=16)
    assert stored == typed and typed == stored and hash(stored) == hash(typed) and {typed: 1}[stored] == 1
    assert stored != WindowSpec("news-sample", n_samples=2, seq_len=16)
    assert isinstance(stored.for_source("news-sample"), StoredWindowSpec)
    assert isinstance(dataclasses.replace(stored, n_samples=4), StoredWindowSpec)
    assert may_fetch(typed) and not may_fetch(stored) and not may_fetch(stored.for_source("news-sample"))


def test_a_table_read_from_its_file_names_its_text_as_stored():
    from gap_engine.tables.artefact import TableSpec

    spec = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", rate_grid=(0.0, 0.5))
    read_back = TableSpec.from_dict(spec.to_dict())
    assert read_back == spec and isinstance(read_back.windows, StoredWindowSpec)


def test_a_hub_dataset_named_in_a_file_is_refused_without_asking_the_hub(monkeypatch):
    import datasets

    def no_network(*args, **kwargs):
        raise AssertionError(f"load_dataset{args} was called")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    with pytest.raises(DataError, match=r"\(named in a file\) is not in the local datasets cache; names read from files never reach"):
        read_corpus("nobody-gap/no-such-dataset:default:train", hub=False)
