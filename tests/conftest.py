"""Shared pytest fixtures: the real built-in model (``smol``: its name says it loads the weights),
its tokenizer alone (``smol_tokenizer``), and tiny models from configs (``make_tiny``: tokenizer only).

``make test-fast`` (``GAP_TEST_TIER=fast``) is the tier that never loads a real model's weights:
a test that uses ``smol`` is marked ``slow`` here, any other that loads a built-in model is marked
``slow`` in its file, and the fast tier checks the marks instead of trusting them. It runs on a
cache of its own, where no built-in model is converted, and a load of one fails the test that
asked for it: in this process at once, in a subprocess (the CLI) when the test ends, by the
converted folder it left behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 49152  # the SmolLM2 tokenizer's, so tiny models read real tokenised text


@pytest.fixture(scope="session")
def smol():
    """The real SmolLM2-135M as a LoadedModel (converted once into the cache). Do not mutate:
    tests that prune load their own copy with ``load_model``."""
    from gap_engine.model.loading import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The real SmolLM2-135M tokenizer, read without the weights (tiny models read real text
    through it): from the converted copy when the cache has one, else from the GGUF's own
    metadata (seconds; converting the weights would take a minute)."""
    from transformers import AutoTokenizer

    from gap_engine.model.loading import BUILTIN_MODELS, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    if tokenizer is not None:
        return tokenizer
    gguf = BUILTIN_MODELS["smollm2-135m"].locate_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)


def tiny_config(model_type: str, **overrides):
    """A two-layer config of the given family, hidden 32/64: fast, randomly initialised.

    Any model type transformers knows is built the same way, so a new family's adapter is tested
    by the suites that run over ``supported_model_types()`` without a line here."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if model_type == "gemma3_text":  # a window shorter than the test texts, so sliding attention is exercised
        common.setdefault("sliding_window", 16)
        common.setdefault("layer_types", ["sliding_attention", "full_attention"][: common["num_hidden_layers"]])
    return AutoConfig.for_model(model_type, **common)


def tiny_lm(model_type: str, tokenizer, seed: int = 0, **overrides):
    """A LoadedModel wrapping a tiny randomly initialised model of the given family."""
    from transformers import AutoModelForCausalLM

    from gap_engine.model.loaded import LoadedModel

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    return LoadedModel.from_transformers(model, tokenizer, f"tiny-{model_type}", "config")


def as_loaded(lm, folder: Path):
    """``lm`` saved to ``folder`` and loaded back as a user's folder loads: with the tokenizer
    loading builds for the family (a Qwen2 config turns the SmolLM2 tokenizer.json into Qwen2's
    pipeline), so a checkpoint of it reloads with the same fingerprint."""
    from gap_engine.model.loading import load_model

    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return load_model(str(folder))


@pytest.fixture
def make_tiny(smol_tokenizer):
    """Factory fixture: make_tiny('qwen3') -> LoadedModel."""
    return lambda model_type, **kw: tiny_lm(model_type, smol_tokenizer, **kw)


def stop_jobs(manager, timeout: float) -> bool:
    """Cancel every active job of ``manager`` and wait for all to end; True when all did within ``timeout``."""
    for job in manager.jobs(active_only=True):
        job.cancel()
    return wait_jobs(manager, timeout)


def wait_jobs(manager, timeout: float) -> bool:
    """Wait for every current job of ``manager`` to end; True when all did within ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    return all(job.wait(max(0.0, deadline - time.monotonic())) for job in manager.jobs())


def wait_for(predicate, timeout=5.0):
    """Poll ``predicate`` until it holds; True when it did within ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


# ---- make test-fast: no real weights --------------------------------------------------------
FAST_TIER = os.environ.get("GAP_TEST_TIER") == "fast"
REAL_WEIGHT_FIXTURES = {"smol"}  # fixtures that load a built-in model's weights (others reach them through these)
_fast_cache: Path | None = None


# ---- every tier: the user's cache is read for converted weights, never written with tables ----------
# A test's tables, plans, dense numbers and run history go to a cache of this session's own: in the
# user's cache, a table of a temporary tiny model outlives its folder, and `make run` would open it.
# The converted built-in weights are shared (a minute per model to convert, the same bytes for all).
USER_CACHE = Path(os.environ.get("GAP_CACHE_DIR") or Path(__file__).resolve().parents[1] / "cache")
# What `make run` lists and opens; the dense numbers are keyed by content (and a benchmark running
# beside the tests writes them).
GUARDED = ("tables", "plans", "runs")
_session_cache: Path | None = None
_guarded_before: set[str] = set()


def guarded_entries() -> set[str]:
    """What the user's cache holds in the folders a test must never write to."""
    return {f"{name}/{entry.name}" for name in GUARDED if (USER_CACHE / name).is_dir() for entry in (USER_CACHE / name).iterdir()}


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def share_cores_between_workers() -> None:
    """Under pytest-xdist (``make test`` runs two workers), give each worker, and the CLI, app and Ray
    processes its tests start, an equal share of the cores. torch's default of one thread per core in
    every process puts two workers' OpenMP threads on the same cores, where they wait on each other."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = max(1, usable_cores() // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the subprocesses' torch at import
    torch.set_num_threads(threads)


def pytest_configure(config):
    """Every tier: the session's own cache (GAP_CACHE_DIR, inherited by the CLI and app
    subprocesses). The fast tier: no converted built-in model in it, and a loader that fails the
    test which loads one in this process; the full tier: the user's converted models shared.
    Under pytest-xdist, each worker's share of the cores (`share_cores_between_workers`)."""
    global _fast_cache, _session_cache, _guarded_before
    share_cores_between_workers()
    if FAST_TIER:
        _setup_fast_tier()
        return
    _session_cache = Path(tempfile.mkdtemp(prefix="gap-test-cache-"))
    (USER_CACHE / "models").mkdir(parents=True, exist_ok=True)
    (_session_cache / "models").symlink_to(USER_CACHE / "models", target_is_directory=True)
    os.environ["GAP_CACHE_DIR"] = str(_session_cache)
    _guarded_before = guarded_entries()


def _setup_fast_tier():
    global _fast_cache
    _fast_cache = Path(tempfile.mkdtemp(prefix="gap-test-fast-"))
    os.environ["GAP_CACHE_DIR"] = str(_fast_cache)
    from gap_engine.model import loading

    def refuse_real_weights(spec, *args, **kwargs):
        pytest.fail(f"loads the real {spec.name} weights: mark the test slow (make test-fast never loads a real model)", pytrace=False)

    loading._load_builtin = refuse_real_weights


def pytest_unconfigure(config):
    for folder in (_fast_cache, _session_cache):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # a symlink inside is removed, not followed


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test that uses a real-weights fixture is slow, whatever its file says (before ``-m`` selects)."""
    for item in items:
        if REAL_WEIGHT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _user_cache_untouched():
    """A test that wrote tables, plans or run history into the user's cache fails
    (one that unset GAP_CACHE_DIR and ran a command): the next `make run` would read them."""
    yield
    if _session_cache is None:
        return
    written = sorted(guarded_entries() - _guarded_before)
    if written:
        _guarded_before.update(written)  # reported once, by the test that wrote them
        pytest.fail(
            f"wrote into the user's cache {USER_CACHE}: {', '.join(written[:5])}: set GAP_CACHE_DIR to a temporary folder", pytrace=False
        )


@pytest.fixture(autouse=True)
def _fast_tier_converts_nothing():
    """In the fast tier, a test after which a built-in model was converted into the tier's cache
    (a subprocess loaded it) fails; the folder goes, so the next test is judged on its own."""
    yield
    if _fast_cache is None:
        return
    converted = sorted(path.name for path in (_fast_cache / "models").glob("*") if path.is_dir())
    for name in converted:
        shutil.rmtree(_fast_cache / "models" / name, ignore_errors=True)
    if converted:
        pytest.fail(
            f"loaded the real {', '.join(converted)} weights: mark the test slow (make test-fast never loads a real model)", pytrace=False
        )


# ---- the slowest tests against their budgets ----------------------------------------------------
BUDGETS = Path(__file__).with_name("budgets.toml")
SLOWEST_SHOWN = 10


def time_budget(nodeid: str, table: dict) -> float:
    """The budget of a test: the longest ``budgets`` key its node id starts with, else ``default``."""
    keys = [key for key in table.get("budgets", {}) if nodeid.startswith(key)]
    return float(table["budgets"][max(keys, key=len)] if keys else table["default"])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The ten slowest tests beside their budgets (tests/budgets.toml), those over it flagged;
    never a failure: a busy machine stretches every time."""
    seconds: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                seconds[report.nodeid] += report.duration  # setup, call and teardown
    try:
        import tomllib  # Python 3.11 on, as CI runs
    except ModuleNotFoundError:
        return
    if not seconds:
        return
    table = tomllib.loads(BUDGETS.read_text(encoding="utf-8"))
    over = {nodeid for nodeid, spent in seconds.items() if spent > time_budget(nodeid, table)}
    terminalreporter.write_sep("=", f"the {SLOWEST_SHOWN} slowest tests and their budgets (tests/budgets.toml)")
    for nodeid, spent in sorted(seconds.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]:
        flag = "  OVER BUDGET" if nodeid in over else ""
        terminalreporter.write_line(f"{spent:8.1f} s  of {time_budget(nodeid, table):5.0f} s  {nodeid}{flag}")
    slowest = set(sorted(seconds, key=lambda nodeid: -seconds[nodeid])[:SLOWEST_SHOWN])
    for nodeid in sorted(over - slowest):
        terminalreporter.write_line(f"{seconds[nodeid]:8.1f} s  of {time_budget(nodeid, table):5.0f} s  {nodeid}  OVER BUDGET")
    if over:
        terminalreporter.write_line(f"{len(over)} test(s) over their budget (a report, not a failure)")
