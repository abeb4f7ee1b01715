"""What the explorer's tests share: a fresh cache per test with the converted built-in model
linked in, a tiny real loss table (SmolLM2-135M, news-sample, 2 windows of 16 tokens, taylor,
rates 0 / 0.25 / 0.5 / 0.75), and an AppTest session opened at a URL (tests/explorer/, tests/cli/)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import stop_jobs
from streamlit.testing.v1 import AppTest

from explorer import ownership
from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import load_corpus
from gap_engine.pipeline.jobs import manager
from gap_engine.pipeline.stages import loss_table
from gap_engine.tables import cache
from gap_engine.tables.artefact import TableSpec

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")
TINY_SPEC = TableSpec(
    windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", objective="nll", rate_grid=(0.0, 0.25, 0.5, 0.75)
)


def link_models(cache_dir: Path) -> None:
    from gap_engine.core.fsutil import cache_root

    models = cache_root() / "models"
    cache_dir.mkdir(parents=True, exist_ok=True)
    if models.is_dir() and not (cache_dir / "models").exists():
        (cache_dir / "models").symlink_to(models, target_is_directory=True)


@pytest.fixture(scope="module")
def tiny_table(smol):
    return loss_table(smol, TINY_SPEC, use_cache=False)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache for tables and runs, with the built-in model linked in."""
    link_models(tmp_path / "cache")
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    yield tmp_path / "cache"
    stop_jobs(manager(), timeout=60)


@pytest.fixture
def cached_table(fresh_cache, tiny_table, smol):
    """The tiny table stored in the fresh cache (the key is what loss_table would give it)."""
    from gap_engine.tables.artefact import table_key

    assert tiny_table.key == table_key(smol, TINY_SPEC, load_corpus("news-sample").fingerprint)
    cache.put_table(tiny_table)
    return tiny_table


def start(page: str | None = None, query: dict | None = None, token: str | None = None) -> AppTest:
    """A new session of the app (opened at a URL with the query string ``query``), on ``page``;
    ``token``: the browser's (explorer/ownership.py; AppTest sends no cookie), so that two
    sessions given the same token are two tabs, or a reload, of one browser (None: a new browser)."""
    at = AppTest.from_file(APP, default_timeout=240)
    at.query_params.update(query or {})
    if token is not None:
        at.session_state[ownership.TOKEN_KEY] = token
    at.run()
    if page:
        at.switch_page(page)
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def job_of(at: AppTest, kind: str):
    return manager().get(at.session_state["app_jobs"][kind])


def texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def plotly_specs(at: AppTest) -> list[dict]:
    return [json.loads(el.proto.spec) for el in at.get("plotly_chart")]


def values(v) -> np.ndarray:
    """A Plotly JSON array: a plain list, or plotly's base64 typed array {"dtype", "bdata", "shape"}."""
    if isinstance(v, dict) and "bdata" in v:
        out = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        shape = v.get("shape")
        if shape:
            out = out.reshape([int(n) for n in str(shape).split(",")])
        return out
    return np.asarray(v, dtype=float)


def start_exact_build(at: AppTest):
    """Press Build for an exact table on 4 x 64 tokens (long enough to act on while it runs); its job."""
    at.radio(key="setup_estimator").set_value("exact")
    at.selectbox(key="setup_builtin_data").set_value("news-sample")
    at.number_input(key="setup_samples").set_value(4)
    at.number_input(key="setup_seq_len").set_value(64)
    at.button(key="setup_build").click().run()
    return job_of(at, "table")


def tiny_eval(at: AppTest, save: bool = False, task_limit: int | None = None) -> None:
    """Small held-out settings; task accuracy off unless ``task_limit`` examples of the offline task are asked for."""
    at.toggle(key="eval_tasks_on").set_value(task_limit is not None)
    if task_limit is not None:
        at.run()  # the task fields are drawn once the toggle is on
        at.number_input(key="eval_task_limit").set_value(task_limit)
    at.number_input(key="eval_samples").set_value(2)
    at.number_input(key="eval_seq_len").set_value(16)
    at.number_input(key="eval_generations").set_value(1)
    at.number_input(key="eval_max_new_tokens").set_value(2)
    at.toggle(key="eval_throughput").set_value(False)
    at.toggle(key="eval_save_checkpoint").set_value(save)
    at.multiselect(key="eval_sources").set_value(["news-sample"])
