"""Shared pytest fixtures: the real built-in model (``smol``: its name says it loads the weights),
its tokenizer alone (``smol_tokenizer``), and tiny models from configs (``make_tiny``: tokenizer only)."""

from __future__ import annotations

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
    """The real SmolLM2-135M tokenizer, read without the weights from the converted copy (tiny
    models read real text through it). Only a cache that never converted the built-in model
    loads it once, to convert it."""
    from gap_engine.model.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    return tokenizer if tokenizer is not None else load_model("smollm2-135m").tokenizer


def tiny_config(model_type: str, **overrides):
    """A two-layer config of the given family, hidden 32/64: fast, randomly initialised."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

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
    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "gemma3_text": Gemma3TextConfig,
    }
    if model_type == "gemma3_text":
        common.setdefault("sliding_window", 16)
        common.setdefault("layer_types", ["sliding_attention", "full_attention"][: common["num_hidden_layers"]])
    return classes[model_type](**common)


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
