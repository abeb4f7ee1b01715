"""Hostile-input benchmark of the ``gap`` command line: several hundred scripted cases.

Each case is one ``gap`` command over inputs made for it: loss tables, plans (JSON and YAML),
options, tampered checkpoints, text sources, output paths, the cache and the environment, a
full disk (``RLIMIT_FSIZE`` in the child) and rows of the run history. The variants are
generated from a few valid artefacts (a hand-written two-layer table, a plan, a tiny random
Llama with the real SmolLM2 tokenizer and two pruned checkpoints of it) by changing one
thing at a time.

Every case runs in a forked child of one process that imported the engine once (so a case
costs milliseconds to a second, not an interpreter start), with its own folder, environment
and a time limit. Each is classified:

- **clean**: exit 2 with exactly one stderr line ``gap: error: ...`` (bad input), or exit 0
  for the few valid controls (``expect="ok"``);
- **internal error**: exit 70 (the CLI's last line of defence caught an exception of ours);
- **hang**: still running at the time limit (killed);
- **wrong success**: exit 0 where the input was bad;
- **input destroyed**: any input file of the case changed or vanished;
- **unclean**: anything else (more than one line, another status, a traceback).

    python bench/bench_hostile.py [--out bench/results/hostile.md] [--timeout 60] [--only SUBSTRING] [--family PREFIX]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import hostile_declared  # beside this file: tensors a folder stores against those its config declares
import hostile_meaning  # beside this file: saved files, numbers, inputs and links read for meaning
import hostile_rules_and_identity  # beside this file: option rules, caches, paths, bounds and model identity
from report import command_line, machine_line, script_argv, with_header

from gap_engine.core.fsutil import atomic_write_text

SCRIPT = "bench/bench_hostile.py"

DEEP = 200_000
# "gap: error: ..." or argparse's "gap prune: error: ..." (OneLineParser: one line too).
ERROR_LINE = re.compile(r"^gap( [a-z]+)*: error: ")
# What a command prints while it works (gap_engine's INFO lines, stages, counters) never names an
# error, a traceback or an exception; a line that does is not progress.
NOT_PROGRESS = re.compile(r"error|traceback|exception|warning", re.IGNORECASE)
BIG_INT = "9" * 400


@dataclass
class Case:
    name: str
    family: str
    argv: list  # gap arguments; "{d}" in an item is replaced by the case's folder
    prepare: Callable[[Path], None] | None = None  # writes the case's inputs into its folder
    expect: str = "refuse"  # "refuse" (exit 2, one line) or "ok" (a valid control)
    verify: Callable[[Path], str | None] | None = None  # after exit 0 of an "ok" case: why its output is wrong, or None
    env: dict = field(default_factory=dict)
    cwd: str | None = None  # relative to the case folder
    file_limit: int | None = None  # RLIMIT_FSIZE bytes in the child: a full disk
    # A stdin that stays open and silent (a prompt would wait on it), files that must not
    # appear (a marker a folder's code writes when imported: "code executed"; anything else written
    # where it does not belong: "foreign write"), stderr sent elsewhere, a working folder deleted first.
    stdin_open: bool = False
    marker: str | None = None  # relative to the case folder
    absent: tuple = ()  # globs relative to the case folder
    stderr_to: str | None = None  # e.g. /dev/full: then only the exit status is judged
    cwd_gone: bool = False
    # What must be merged before the case can be clean (a fix another branch makes): its verdict is
    # reported, but it does not fail the run until this is emptied.
    pending: str = ""
    says: str = ""  # a refusal's line must say this ("{d}" filled in): a line that names no cause is no answer


# ---- the valid artefacts every variant starts from -----------------------------------------------
def table_dict() -> dict:
    return {
        "format_version": 2,
        "key": "tiny-nll-split-taylor-0123456789abcdef0123",
        "model": "tiny-llama",
        "model_fingerprint": "0123456789abcdef",
        "num_layers": 2,
        "spec": {"data": "news-sample", "n_samples": 2, "seq_len": 16, "estimator": "taylor", "rate_grid": [0.0, 0.5]},
        "data_fingerprint": "f" * 64,
        "components": [[0, "attn"], [0, "mlp"], [1, "attn"], [1, "mlp"]],
        "rate_grid": [0.0, 0.5],
        "dense_objective": 3.5,
        "dense_prunable": 61_440,  # the tiny Llama's geometry: a table for it removes what it removes
        "build_seconds": 1.0,
        "delta": [[0.0, 0.2], [0.0, 0.4], [0.0, -0.01], [0.0, 0.3]],
        "smoothed": [[0.0, 0.2], [0.0, 0.4], [0.0, 0.0], [0.0, 0.3]],
        "cell_objective": [[3.5, 3.7], [3.5, 3.9], [3.5, 3.49], [3.5, 3.8]],
        "removed": [[0, 6_144], [0, 9_216], [0, 6_144], [0, 9_216]],
        "extras": {},
        "window_start": "bos",
        "measured": [[True, False]] * 4,
        "cell_tokens": None,
        "estimate": None,
    }


def full_table_spec() -> dict:
    """The synthetic table's spec as TableSpec writes it (filled in at setup)."""
    from gap_engine.core.config import WindowSpec
    from gap_engine.tables.artefact import TableSpec

    return TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", rate_grid=(0.0, 0.5)).to_dict()


def plan_dict() -> dict:
    return {
        "model": "tiny-llama",
        "model_fingerprint": None,
        "num_layers": 2,
        "criterion": "magnitude",
        "attention_rates": [0.5, 0.0],
        "mlp_rates": [0.25, 0.25],
        "channel_multiple": 8,
        "params": {},
        "allocator": "manual",
        "budget": 0.25,
        "predicted_loss": None,
        "table_key": None,
        "created": "2026-11-30T12:00:00+00:00",
        "format_version": 2,
    }


def build_fixtures(base: Path) -> None:
    """The tiny model folder, a uniform and a DP checkpoint, in ``base`` (run in a child)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.loaded import LoadedModel
    from gap_engine.model.loading import load_model
    from gap_engine.model.rateplan import make_plan, uniform_plan
    from gap_engine.pipeline.stages import prune_with_plan

    tokenizer = load_model("smollm2-135m").tokenizer
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(base / "tiny-llama")
    tokenizer.save_pretrained(base / "tiny-llama")
    dense = LoadedModel.from_transformers(
        AutoModelForCausalLM.from_pretrained(base / "tiny-llama", dtype=torch.float32), tokenizer, "tiny-llama", "config"
    )
    (base / "tiny-llama.fingerprint").write_text(dense.fingerprint)
    for name, make in (
        ("ck", lambda lm: uniform_plan(lm, 0.5, "magnitude")),
        ("dp", lambda lm: make_plan(lm, [0.5, 0.0], [0.5, 0.25], "magnitude", allocator="dp")),
    ):
        lm = LoadedModel.from_transformers(
            AutoModelForCausalLM.from_pretrained(base / "tiny-llama", dtype=torch.float32), tokenizer, "tiny-llama", "config"
        )
        plan = make(lm)
        result = prune_with_plan(lm, plan, WindowSpec(n_samples=2, seq_len=16))
        save_pruned(lm, plan, result.kept_indices(), base / name)


# ---- helpers that write a case's inputs ---------------------------------------------------------
def write(name: str, content) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())

    return prepare


def both(*steps) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        for step in steps:
            step(d)

    return prepare


def copy_fixture(name: str, as_name: str | None = None) -> Callable[[Path], None]:
    return lambda d: shutil.copytree(FIXTURES / name, d / (as_name or name), symlinks=True)


def fifo(name: str) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()
        os.mkfifo(path)

    return prepare


def edit_json(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        path = d / name
        data = json.loads(path.read_text())
        result = change(data)
        path.write_text(result if isinstance(result, str) else json.dumps(data))

    return prepare


FIXTURES = Path()  # set in main()


# ---- case families ----------------------------------------------------------------------------
TABLE_VALUES = {
    "num_layers": [None, "2", 0, -1, 2.5, 10**9, "BIG", [2], {"a": 1}, 3, True],
    "dense_prunable": [None, 0, -5, "x", 1.5, "BIG", [1], 1e300],
    "dense_objective": [None, "x", [1], "INF", True],
    "build_seconds": [-1.0, "x", [1], "INF"],
    "delta": [None, "x", [[0.0, "x"]] * 4, [[0.0, 0.1]] * 3, [[0.0]] * 4, [[0.0, "INF"]] * 4, [["BIG", 0.0]] * 4, {"a": 1}],
    "smoothed": ["x", [[0.0, -1.0]] * 4, [[0.0, 0.1]] * 5, [[0.0, "BIG"]] * 4],
    "removed": [None, [[0, 1e30]] * 4, [[0, 0.5]] * 4, [[0, -1]] * 4, [[0, "BIG"]] * 4, "x", [[0, 4000]] * 3],
    "cell_objective": [None, [[0.0, "x"]] * 4, [[0.0, "INF"]] * 4, [1, 2]],
    "components": [
        None,
        [[0, "attn"]] * 4,
        [[0.7, "attn"], [0, "mlp"], [1, "attn"], [1, "mlp"]],
        [[0, "x"], [0, "mlp"], [1, "attn"], [1, "mlp"]],
        [[5, "attn"], [0, "mlp"], [1, "attn"], [1, "mlp"]],
        [["BIG", "attn"], [0, "mlp"], [1, "attn"], [1, "mlp"]],
        "x",
        [[0], [0], [1], [1]],
    ],
    "rate_grid": [None, [0.0], "x", [0.0, 0.9], [0.0, "x"]],
    "spec": [None, "x", {"seq_len": 10**9}, {"n_samples": "2"}, {"seed": -1}, {"seq_len": "BIG"}],
    "measured": [[[2, 1]] * 4, [[{"a": 1}, True]] * 4, [["BIG", True]] * 4, [[0.5, True]] * 4, "x"],
    "cell_tokens": [[[0, 1e300]] * 4, [[0, "BIG"]] * 4, [[0, -1]] * 4, [[0, 1.5]] * 4, "x"],
    "estimate": [[[0.0, "BIG"]] * 4, [[0.0, "x"]] * 4, "x", [[0.0, "INF"]] * 4],
    "window_start": [None, "x", ["bos"], 1],
    "model": [None, ["a"], "a\nb", "m" * 10_000, 5],
    "format_version": [1, 3, "2", None],
    "extras": ["x", [1]],
    "key": [["k"], "k\x1b[31m"],
}


def _table_text(field_name: str, value) -> str:
    data = table_dict()
    data["spec"] = full_table_spec()
    fingerprint = FIXTURES / "tiny-llama.fingerprint"
    if fingerprint.is_file():  # the table is then the tiny model's: plan and compare load it
        data["model"], data["model_fingerprint"] = str(FIXTURES / "tiny-llama"), fingerprint.read_text()
    if field_name == "spec" and isinstance(value, dict):
        data["spec"] = data["spec"] | value
    else:
        data[field_name] = value
    text = json.dumps(data)
    return text.replace('"BIG"', BIG_INT).replace('"INF"', "1e999")


def valid_table_text() -> str:
    """The valid two-layer table of the tiny model (every family's control)."""
    return _table_text("extras", {})


def table_cases() -> list[Case]:
    cases = []
    for field_name, values in TABLE_VALUES.items():
        for i, value in enumerate(values):
            text = _table_text(field_name, value)
            for command in ("front", "plan", "report"):
                if (i + len(field_name)) % 3 != ("front", "plan", "report").index(command) and command != "front":
                    continue  # every value under front, a third also under plan or report
                argv = {
                    "front": ["front", "--table", "{d}/t.json", "--out", "{d}/out/f.csv"],
                    "plan": ["plan", "--table", "{d}/t.json", "--budget", "0.2", "--model", "{fx}/tiny-llama", "--out", "{d}/out/p.json"],
                    "report": ["report", "--table", "{d}/t.json", "--budget", "0.2", "--out", "{d}/out/r.html"],
                }[command]
                cases.append(Case(f"table {field_name}={str(value)[:30]} ({command})", "tables", argv, write("t.json", text)))
    bombs = {
        "nested-200k": "[" * DEEP + "]" * DEEP,
        "truncated": json.dumps(table_dict())[:-30],
        "not-utf8": b"\xff" + json.dumps(table_dict()).encode(),
        "empty": "",
        "a-list": "[1, 2]",
        "null": "null",
        "nul-bytes": "{\x00}",
        "yaml-in-json": "a: [b",
    }
    for name, text in bombs.items():
        cases.append(
            Case(f"table file {name}", "tables", ["front", "--table", "{d}/t.json", "--out", "{d}/out/f.csv"], write("t.json", text))
        )
    cases.append(
        Case(
            "table control (valid)",
            "tables",
            ["front", "--table", "{d}/t.json", "--out", "{d}/out/f.csv"],
            write("t.json", _table_text("extras", {})),
            expect="ok",
        )
    )
    return cases


PLAN_VALUES = {
    "num_layers": ["2", 0, 3, 1e999, "BIG", 2.5],
    "attention_rates": [[0.5], [0.5, "x"], [1.0, 0.0], [-0.1, 0.0], ["BIG", 0.0], [True, 0.0], "x", [0.5, "INF"]],
    "mlp_rates": [[0.25], [0.25, None], [2, 0.0]],
    "criterion": ["psychic", 5, ["wanda"]],
    "channel_multiple": [0, -8, "8", "BIG", 2.5],
    "model": [["a"], "a\nb", "m" * 10_000],
    "budget": ["x", "INF", [0.2]],
    "params": ["x", {"removed": {"a": [1]}}],
    "created": [5, ["x"], "a\nb"],
    "format_version": [99, "2"],
}


def plan_cases() -> list[Case]:
    cases = []
    argv = ["prune", "--model", "{fx}/tiny-llama", "--plan", "{d}/{file}", "--out", "{d}/out/pruned"]
    for field_name, values in PLAN_VALUES.items():
        for value in values:
            data = plan_dict() | {field_name: value}
            text = json.dumps(data).replace('"BIG"', BIG_INT).replace('"INF"', "1e999")
            cases.append(
                Case(
                    f"plan {field_name}={str(value)[:30]}",
                    "plans",
                    [a.replace("{file}", "plan.json") for a in argv],
                    write("plan.json", text),
                )
            )
    fields_yaml = lambda skip: "\n".join(f"{k}: {json.dumps(v)}" for k, v in plan_dict().items() if k != skip)  # noqa: E731
    yaml_lines = {
        "created 2024-02-30": ("created", "created: 2024-02-30"),
        "created hour 25": ("created", "created: 2024-02-01 25:00:00"),
        "created a date": ("created", "created: 2025-01-01"),
        "!!int abc": ("budget", 'budget: !!int "abc"'),
        "!!float abc": ("budget", 'budget: !!float "abc"'),
        "!!timestamp x": ("created", 'created: !!timestamp "x"'),
        "!!bool maybe": ("budget", 'budget: !!bool "maybe"'),
        "!!python/object": ("model", "model: !!python/object/apply:os.system ['echo pwned']"),
        "!!binary": ("model", "model: !!binary aGVsbG8="),
        "!!set": ("params", "params: !!set {a, b}"),
        "5001-digit int": ("num_layers", "num_layers: " + "9" * 5001),
        "400-digit int": ("num_layers", "num_layers: " + BIG_INT),
        "hex int huge": ("num_layers", "num_layers: 0x" + "f" * 40),
        "alias": ("params", "params: &a {x: 1}\nextra: *a"),
        "merge key into a field": ("budget", "budget:\n  <<: {x: 1}"),
        "nested 200k": ("model", "model: " + "[" * DEEP + "]" * DEEP),
        "budget .nan": ("budget", "budget: .nan"),
        "budget .inf": ("budget", "budget: .inf"),
        "two documents": ("model", "model: tiny-llama\n---\nmodel: other"),
    }
    for name, (skip, line) in yaml_lines.items():
        text = line + "\n" + fields_yaml(skip) + "\n"
        cases.append(Case(f"plan.yaml {name}", "plans", [a.replace("{file}", "plan.yaml") for a in argv], write("plan.yaml", text)))
    cases.append(
        Case(
            "plan control (valid)",
            "plans",
            [a.replace("{file}", "plan.json") for a in argv],
            write("plan.json", json.dumps(plan_dict())),
            expect="ok",
        )
    )
    return cases


def option_cases() -> list[Case]:
    t = ["--table", "{d}/t.json"]
    table_file = write("t.json", _table_text("extras", {}))
    model = ["--model", "{fx}/tiny-llama"]
    raw = {
        "prune --uniform 1": (["prune", *model, "--uniform", "1", "--out", "{d}/o"], None),
        "prune --uniform -0.1": (["prune", *model, "--uniform", "-0.1", "--out", "{d}/o"], None),
        "prune --uniform nan": (["prune", *model, "--uniform", "nan", "--out", "{d}/o"], None),
        "prune --uniform inf": (["prune", *model, "--uniform", "inf", "--out", "{d}/o"], None),
        "prune --uniform 1e999": (["prune", *model, "--uniform", "1e999", "--out", "{d}/o"], None),
        "prune no rate": (["prune", *model, "--out", "{d}/o"], None),
        "prune two rates": (["prune", *model, "--uniform", "0.1", "--budget", "0.1", "--out", "{d}/o"], None),
        "prune --channel-multiple 0": (["prune", *model, "--uniform", "0.1", "--channel-multiple", "0", "--out", "{d}/o"], None),
        "prune --channel-multiple huge": (
            ["prune", *model, "--uniform", "0.1", "--channel-multiple", "99999999999", "--out", "{d}/o"],
            None,
        ),
        "prune --rounds 0": (["prune", *model, "--budget", "0.1", "--rounds", "0", "--out", "{d}/o"], None),
        "prune --rounds 999": (["prune", *model, "--budget", "0.1", "--rounds", "999", "--out", "{d}/o"], None),
        "prune --seq-len 1": (["prune", *model, "--uniform", "0.1", "--seq-len", "1", "--out", "{d}/o"], None),
        "prune --samples 0": (["prune", *model, "--uniform", "0.1", "--samples", "0", "--out", "{d}/o"], None),
        "prune --samples 10^6": (["prune", *model, "--uniform", "0.1", "--samples", "1000000", "--out", "{d}/o"], None),
        "prune --batch-size 0": (["prune", *model, "--uniform", "0.1", "--batch-size", "0", "--out", "{d}/o"], None),
        "prune --seed -1": (["prune", *model, "--uniform", "0.1", "--seed", "-1", "--out", "{d}/o"], None),
        "prune --seed 2^70": (["prune", *model, "--uniform", "0.1", "--seed", str(2**70), "--out", "{d}/o"], None),
        "prune --rates 0.5,0": (["prune", *model, "--budget", "0.1", "--rates", "0.5,0", "--out", "{d}/o"], None),
        "prune --rates x": (["prune", *model, "--budget", "0.1", "--rates", "x", "--out", "{d}/o"], None),
        "prune --save-dtype int8": (["prune", *model, "--uniform", "0.1", "--save-dtype", "int8", "--out", "{d}/o"], None),
        "prune --criterion psychic": (["prune", *model, "--uniform", "0.1", "--criterion", "psychic", "--out", "{d}/o"], None),
        "prune --device tpu": (["prune", *model, "--uniform", "0.1", "--device", "tpu", "--out", "{d}/o"], None),
        "prune --dtype int4": (["prune", *model, "--uniform", "0.1", "--dtype", "int4", "--out", "{d}/o"], None),
        "eval --samples 10^6": (["eval", *model, "--samples", "1000000"], None),
        "eval --seq-len 10^5": (["eval", *model, "--seq-len", "100000"], None),
        "eval --generations 1000": (["eval", *model, "--generations", "1000"], None),
        "eval --generations -1": (["eval", *model, "--generations", "-1"], None),
        "eval --max-memory cpu=lots": (["eval", *model, "--device-map", "auto", "--max-memory", "cpu=lots"], None),
        "eval --max-memory x": (["eval", *model, "--device-map", "auto", "--max-memory", "x"], None),
        "eval --max-memory gpu7=1GB": (["eval", *model, "--device-map", "auto", "--max-memory", "gpu7=1GB"], None),
        "eval --max-memory cuda:x=1GB": (["eval", *model, "--device-map", "auto", "--max-memory", "cuda:x=1GB"], None),
        "eval --device-map with --stream": (["eval", *model, "--device-map", "auto", "--stream"], None),
        "plan --budget 1": (["plan", *t, "--budget", "1", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"], table_file),
        "plan --budget -1": (["plan", *t, "--budget", "-1", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"], table_file),
        "plan --budget x": (["plan", *t, "--budget", "x", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"], table_file),
        "plan --keep-params 0": (["plan", *t, "--keep-params", "0", "--out", "{d}/p.json"], table_file),
        "plan --keep-params and --budget": (["plan", *t, "--keep-params", "5", "--budget", "0.2", "--out", "{d}/p.json"], table_file),
        "plan --lock 99": (
            ["plan", *t, "--budget", "0.2", "--lock", "99", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"],
            table_file,
        ),
        "plan --lock x": (["plan", *t, "--budget", "0.2", "--lock", "x", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"], table_file),
        "plan --lock 0:2": (
            ["plan", *t, "--budget", "0.2", "--lock", "0:2", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"],
            table_file,
        ),
        "plan --lock 0.5": (
            ["plan", *t, "--budget", "0.2", "--lock", "0.5", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"],
            table_file,
        ),
        "plan --min-rate > --max-rate": (
            ["plan", *t, "--budget", "0.2", "--min-rate", "0.5", "--max-rate", "0.1", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"],
            table_file,
        ),
        "plan --max-rate x": (
            ["plan", *t, "--budget", "0.2", "--max-rate", "x", "--model", "{fx}/tiny-llama", "--out", "{d}/p.json"],
            table_file,
        ),
        "plan for another model": (["plan", *t, "--budget", "0.2", "--model", "{fx}/ck", "--out", "{d}/p.json"], table_file),
        "front --n-buckets 0": (["front", *t, "--n-buckets", "0", "--out", "{d}/f.csv"], table_file),
        "front --n-buckets 10^9": (["front", *t, "--n-buckets", "1000000000", "--out", "{d}/f.csv"], table_file),
        "report --budget 2": (["report", *t, "--budget", "2", "--out", "{d}/r.html"], table_file),
        "report --run 0": (["report", *t, "--run", "0", "--out", "{d}/r.html"], table_file),
        "report --run -5": (["report", *t, "--run", "-5", "--out", "{d}/r.html"], table_file),
        "report --run 10^20": (["report", *t, "--run", "99999999999999999999", "--out", "{d}/r.html"], table_file),
        "report --run 42 (absent)": (["report", *t, "--run", "42", "--out", "{d}/r.html"], table_file),
        "table --rates 300": (["table", *model, "--rates", ",".join(str(i / 300) for i in range(300)), "--out", "{d}/t2.json"], None),
        "table --rates 0,1": (["table", *model, "--rates", "0,1", "--out", "{d}/t2.json"], None),
        "table --rates empty": (["table", *model, "--rates", "", "--out", "{d}/t2.json"], None),
        "table --ray-workers 0": (["table", *model, "--ray", "--ray-workers", "0", "--out", "{d}/t2.json"], None),
        "table --profile z80": (["table", *model, "--dry-run", "--profile", "z80"], None),
        "table --refine-budgets x": (["table", *model, "--estimator", "refine", "--refine-budgets", "x", "--out", "{d}/t2.json"], None),
        "compare --budgets 100": (["compare", *model, "--budgets", ",".join(["0.1"] * 100), "--out", "{d}/c.csv"], None),
        "compare --allocators psychic": (["compare", *model, "--allocators", "psychic", "--out", "{d}/c.csv"], None),
        "compare --budgets x": (["compare", *model, "--budgets", "x", "--out", "{d}/c.csv"], None),
        "export --outtype q2": (["export", "{fx}/ck", "--outtype", "q2", "--out", "{d}/m.gguf"], None),
        "export --tokenizer-pre path": (["export", "{fx}/ck", "--tokenizer-pre", "../../x\ny", "--out", "{d}/m.gguf"], None),
        "export --tokenizer-pre spaces": (["export", "{fx}/ck", "--tokenizer-pre", "a b", "--out", "{d}/m.gguf"], None),
        "export hf of a dense folder": (["export", "{fx}/tiny-llama", "--format", "hf", "--out", "{d}/hf"], None),
        "recover --steps 0": (["recover", "--model", "{fx}/ck", "--method", "mezo", "--steps", "0", "--out", "{d}/r"], None),
        "recover --steps -1": (["recover", "--model", "{fx}/ck", "--method", "mezo", "--steps", "-1", "--out", "{d}/r"], None),
        "recover --lr nan": (["recover", "--model", "{fx}/ck", "--method", "mezo", "--steps", "1", "--lr", "nan", "--out", "{d}/r"], None),
        "recover --split heldout": (
            ["recover", "--model", "{fx}/ck", "--method", "mezo", "--steps", "1", "--split", "heldout", "--out", "{d}/r"],
            None,
        ),
        "recover --rank 0": (["recover", "--model", "{fx}/ck", "--method", "lora", "--steps", "1", "--rank", "0", "--out", "{d}/r"], None),
        "recover --mask-fraction 2": (
            ["recover", "--model", "{fx}/ck", "--method", "mazo", "--steps", "1", "--mask-fraction", "2", "--out", "{d}/r"],
            None,
        ),
        "recover --targets x_proj": (
            ["recover", "--model", "{fx}/ck", "--method", "lora", "--steps", "1", "--targets", "x_proj", "--out", "{d}/r"],
            None,
        ),
        "recover --time-budget -1": (
            ["recover", "--model", "{fx}/ck", "--method", "mezo", "--steps", "1", "--time-budget", "-1", "--out", "{d}/r"],
            None,
        ),
        "unknown command": (["frobnicate"], None),
        "unknown option": (["front", "--tabel", "x"], None),
        "cache rm absent key": (["cache", "rm", "no-such-key"], None),
        "cache rm ../x": (["cache", "rm", "../../etc"], None),
    }
    return [Case(name, "options", argv, prepare) for name, (argv, prepare) in raw.items()]


def _eval(folder: str) -> list:
    return [
        "eval",
        "--model",
        folder,
        "--no-dense",
        "--no-throughput",
        "--generations",
        "0",
        "--data",
        "news-sample",
        "--samples",
        "2",
        "--seq-len",
        "16",
    ]


def checkpoint_cases() -> list[Case]:
    edits = {
        "config kv 0": edit_json("ck/config.json", lambda c: c.update(num_key_value_heads=0)),
        "config layer heads text": edit_json("ck/config.json", lambda c: c["per_layer_config"]["0"].update(num_attention_heads="two")),
        "config layer heads 400 digits": edit_json(
            "ck/config.json", lambda c: json.dumps(c).replace('"num_attention_heads": 2', '"num_attention_heads": ' + BIG_INT, 1)
        ),
        "config layers 3": edit_json("ck/config.json", lambda c: c.update(num_hidden_layers=3)),
        "config model_type list": edit_json("ck/config.json", lambda c: c.update(model_type=["llama"])),
        "config model_type bert": edit_json("ck/config.json", lambda c: c.update(model_type="bert")),
        "config no per_layer_config": edit_json("ck/config.json", lambda c: c.pop("per_layer_config")),
        "config nested 200k": write("ck/config.json", "[" * DEEP + "]" * DEEP),
        "config 2 MB": write("ck/config.json", json.dumps({"pad": "x" * (2 << 20)})),
        "config not utf8": write("ck/config.json", b"\xff\xfe"),
        "config a FIFO": fifo("ck/config.json"),
        "marker not json": write("ck/gap_pruned.json", "{format_version: 1"),
        "marker a list": write("ck/gap_pruned.json", "[1]"),
        "marker base_model list": edit_json("ck/gap_pruned.json", lambda m: m.update(base_model=["a"] * 5)),
        "marker base_model newline": edit_json("ck/gap_pruned.json", lambda m: m.update(base_model="a\nb")),
        "marker format 2": edit_json("ck/gap_pruned.json", lambda m: m.update(format_version=2)),
        "marker format 400 digits": edit_json(
            "ck/gap_pruned.json", lambda m: json.dumps(m).replace('"format_version": 1', '"format_version": ' + BIG_INT)
        ),
        "marker fingerprint wrong": edit_json("ck/gap_pruned.json", lambda m: m.update(fingerprint="0" * 16)),
        "marker param_count -1": edit_json("ck/gap_pruned.json", lambda m: m.update(param_count=-1)),
        "marker a FIFO": fifo("ck/gap_pruned.json"),
        "weights a FIFO": fifo("ck/model.safetensors"),
        "weights truncated": lambda d: (d / "ck/model.safetensors").write_bytes((d / "ck/model.safetensors").read_bytes()[:5000]),
        "weights garbage": write("ck/model.safetensors", b"\x00" * 4096),
        "weights header huge": write("ck/model.safetensors", (10**15).to_bytes(8, "little") + b"{}"),
        "weights missing": lambda d: (d / "ck/model.safetensors").unlink(),
        "weights a folder": lambda d: ((d / "ck/model.safetensors").unlink(), (d / "ck/model.safetensors").mkdir()),
        "extra FIFO shard": fifo("ck/extra.safetensors"),
        "tokenizer damaged": write("ck/tokenizer.json", '{"version": "1.0", "truncated'),
        "tokenizer a FIFO": fifo("ck/tokenizer.json"),
        "tokenizer_config a FIFO": fifo("ck/tokenizer_config.json"),
        "plan.json nested": write("ck/plan.json", "[" * DEEP + "]" * DEEP),
        "plan.json a FIFO": fifo("ck/plan.json"),
        "a socket-like device link": lambda d: (
            (d / "ck/model.safetensors").unlink() or (d / "ck/model.safetensors").symlink_to("/dev/zero")
        ),
    }
    cases = [
        Case(f"checkpoint {name} (eval)", "checkpoints", _eval("{d}/ck"), both(copy_fixture("ck"), edit)) for name, edit in edits.items()
    ]
    kept = {
        "nested 200k": "[" * DEEP + "]" * DEEP,
        "not utf8": b"\xff\xfe{}",
        "a list": "[1]",
        "truncated": '{"kept_heads": [[0, 1]',
        "index text": json.dumps({"kept_kv_heads": [["a"]], "kept_heads": [[0]], "kept_channels": [[0]]}),
        "index 400 digits": '{"kept_kv_heads": [[' + BIG_INT + ']], "kept_heads": [[0]], "kept_channels": [[0]]}',
        "index fraction": json.dumps({"kept_kv_heads": [[0.5]], "kept_heads": [[0]], "kept_channels": [[0]]}),
        "index repeated": json.dumps({"kept_kv_heads": [[0, 0]], "kept_heads": [[0]], "kept_channels": [[0]]}),
    }
    for name, content in kept.items():
        cases.append(
            Case(
                f"checkpoint kept_indices {name} (export hf)",
                "checkpoints",
                ["export", "{d}/ck", "--format", "hf", "--out", "{d}/out"],
                both(copy_fixture("ck"), write("ck/kept_indices.json"[0:], content)),
            )
        )
    cases.append(
        Case(
            "checkpoint kept_indices a FIFO (export hf)",
            "checkpoints",
            ["export", "{d}/ck", "--format", "hf", "--out", "{d}/out"],
            both(copy_fixture("ck"), fifo("ck/kept_indices.json")),
        )
    )
    for name, edit in list(edits.items())[:12]:
        cases.append(
            Case(
                f"checkpoint {name} (export gguf)",
                "checkpoints",
                ["export", "{d}/ck", "--out", "{d}/m.gguf"],
                both(copy_fixture("ck"), edit),
            )
        )
    cases.append(Case("checkpoint control (eval)", "checkpoints", _eval("{d}/ck"), copy_fixture("ck"), expect="ok"))
    cases.append(Case("dp checkpoint control (eval)", "checkpoints", _eval("{d}/dp"), copy_fixture("dp"), expect="ok"))
    cases.append(
        Case(
            "checkpoint base_model a hub id (eval, dense reference local only)",
            "checkpoints",
            _eval("{d}/ck")[:3] + _eval("{d}/ck")[4:],
            both(copy_fixture("ck"), edit_json("ck/gap_pruned.json", lambda m: m.update(base_model="some-org/some-model"))),
            expect="ok",
        )
    )
    return cases


def text_cases() -> list[Case]:
    good = json.dumps({"text": "A plain sentence about pruning that is long enough to be a document. " * 4})
    files = {
        "jsonl nested 200k": ("docs.jsonl", good + '\n{"text": "x", "meta": ' + "[" * DEEP + "]" * DEEP + "}\n"),
        "jsonl line a list": ("docs.jsonl", good + '\n["a"]\n'),
        "jsonl truncated": ("docs.jsonl", good + '\n{"text": "unterminated\n'),
        "jsonl text a number": ("docs.jsonl", good + '\n{"text": 5}\n'),
        "jsonl lone surrogate": ("docs.jsonl", good + '\n{"text": "bad \\ud800 surrogate"}\n'),
        "jsonl 400-digit int": ("docs.jsonl", good + '\n{"text": "x", "n": ' + BIG_INT + "}\n"),
        "txt not utf8": ("docs.txt", b"\xff\xfe\x00bad\n"),
        "txt empty": ("docs.txt", "\n\n \n"),
        "txt NUL bytes": ("docs.txt", "abc\x00def\n"),
        "txt too short": ("docs.txt", "hi\n"),
        "jsonl empty": ("docs.jsonl", ""),
    }
    cases = []
    for name, (file_name, content) in files.items():
        argv = [
            "table",
            "--model",
            "{fx}/tiny-llama",
            "--data",
            "{d}/" + file_name,
            "--estimator",
            "fisher",
            "--samples",
            "2",
            "--seq-len",
            "16",
            "--rates",
            "0,0.5",
            "--no-cache",
            "--out",
            "{d}/out/t.json",
        ]
        cases.append(Case(f"text {name}", "texts", argv, write(file_name, content)))
    specs = {
        "x::train": "x::train",
        "unknown name": "wikipedia-full",
        "missing txt": "{d}/absent.txt",
        "a folder .txt": "{d}/folder.txt",
        "FIFO .txt": "{d}/pipe.txt",
        "FIFO .jsonl": "{d}/pipe.jsonl",
        "/dev/zero as .txt link": "{d}/zero.txt",
        "split with slash": "a:b:c/d",
        "empty spec": "",
        "only commas": ",,,",
        "hub dataset offline": "someone/data::test",
    }

    def prepare_specials(d: Path) -> None:
        (d / "folder.txt").mkdir()
        os.mkfifo(d / "pipe.txt")
        os.mkfifo(d / "pipe.jsonl")
        (d / "zero.txt").symlink_to("/dev/zero")

    for name, spec in specs.items():
        for command in ("table", "eval"):
            if command == "table":
                argv = [
                    "table",
                    "--model",
                    "{fx}/tiny-llama",
                    "--data",
                    spec,
                    "--samples",
                    "2",
                    "--seq-len",
                    "16",
                    "--no-cache",
                    "--out",
                    "{d}/out/t.json",
                ]
            else:
                argv = [
                    "eval",
                    "--model",
                    "{fx}/ck",
                    "--data",
                    spec,
                    "--samples",
                    "2",
                    "--seq-len",
                    "16",
                    "--no-dense",
                    "--no-throughput",
                    "--generations",
                    "0",
                ]
            cases.append(Case(f"text spec {name} ({command})", "texts", argv, prepare_specials))
    return cases


def output_cases() -> list[Case]:
    table_file = write("t.json", _table_text("extras", {}))
    text_file = write("docs.txt", "one document about pruning\n\nanother document about pruning\n")
    raw = {
        "plan --out = --table": (
            ["plan", "--table", "{d}/t.json", "--budget", "0.2", "--model", "{fx}/tiny-llama", "--out", "{d}/t.json"],
            table_file,
            None,
        ),
        "front --out = --table": (["front", "--table", "{d}/t.json", "--out", "{d}/t.json"], table_file, None),
        "report --out = --table": (["report", "--table", "{d}/t.json", "--budget", "0.2", "--out", "{d}/t.json"], table_file, None),
        "report --out = --plan": (
            ["report", "--table", "{d}/t.json", "--plan", "{d}/p.json", "--out", "{d}/p.json"],
            both(table_file, write("p.json", json.dumps(plan_dict()))),
            None,
        ),
        "prune --out = --model": (
            ["prune", "--model", "{d}/ck", "--uniform", "0.3", "--criterion", "magnitude", "--out", "{d}/ck"],
            copy_fixture("ck"),
            None,
        ),
        "prune --out . in the model": (
            ["prune", "--model", ".", "--uniform", "0.3", "--criterion", "magnitude", "--out", "."],
            copy_fixture("ck"),
            "ck",
        ),
        "prune --out holds the model": (
            ["prune", "--model", "{d}/ck", "--uniform", "0.3", "--criterion", "magnitude", "--out", "{d}"],
            copy_fixture("ck"),
            None,
        ),
        "prune --out inside the model": (
            ["prune", "--model", "{d}/ck", "--uniform", "0.3", "--criterion", "magnitude", "--out", "{d}/ck/sub"],
            copy_fixture("ck"),
            None,
        ),
        "prune --out = --plan": (
            ["prune", "--model", "{fx}/tiny-llama", "--plan", "{d}/p.json", "--out", "{d}/p.json"],
            write("p.json", json.dumps(plan_dict())),
            None,
        ),
        "prune --out a link to the model": (
            ["prune", "--model", "{d}/ck", "--uniform", "0.3", "--criterion", "magnitude", "--out", "{d}/link"],
            both(copy_fixture("ck"), lambda d: (d / "link").symlink_to(d / "ck")),
            None,
        ),
        "export gguf --out in the checkpoint": (["export", "{d}/ck", "--out", "{d}/ck/model.safetensors"], copy_fixture("ck"), None),
        "export gguf --out = checkpoint": (["export", "{d}/ck", "--out", "{d}/ck"], copy_fixture("ck"), None),
        "export hf --out = checkpoint": (["export", "{d}/ck", "--format", "hf", "--out", "{d}/ck"], copy_fixture("ck"), None),
        "export hf --out holds checkpoint": (["export", "{d}/ck", "--format", "hf", "--out", "{d}"], copy_fixture("ck"), None),
        "recover --out = --model": (
            ["recover", "--model", "{d}/ck", "--method", "mezo", "--steps", "1", "--out", "{d}/ck"],
            copy_fixture("ck"),
            None,
        ),
        "recover --out inside --model": (
            ["recover", "--model", "{d}/ck", "--method", "mezo", "--steps", "1", "--out", "{d}/ck/r"],
            copy_fixture("ck"),
            None,
        ),
        "recover OUT.partial = --model": (
            ["recover", "--model", "{d}/r.partial", "--method", "mezo", "--steps", "1", "--out", "{d}/r"],
            copy_fixture("ck", "r.partial"),
            None,
        ),
        "table --out = --data": (
            ["table", "--model", "{fx}/tiny-llama", "--data", "{d}/docs.txt", "--samples", "2", "--seq-len", "16", "--out", "{d}/docs.txt"],
            text_file,
            None,
        ),
        "table --out in the model": (
            ["table", "--model", "{d}/ck", "--samples", "2", "--seq-len", "16", "--out", "{d}/ck/t.json"],
            copy_fixture("ck"),
            None,
        ),
        "compare --out = --table": (
            ["compare", "--model", "{fx}/tiny-llama", "--table", "{d}/t.json", "--out", "{d}/t.json"],
            table_file,
            None,
        ),
        "front --out /dev/null": (["front", "--table", "{d}/t.json", "--out", "/dev/null"], table_file, None),
        "front --out a FIFO": (["front", "--table", "{d}/t.json", "--out", "{d}/pipe"], both(table_file, fifo("pipe")), None),
        "front --out under a file": (["front", "--table", "{d}/t.json", "--out", "{d}/t.json/f.csv"], table_file, None),
        "front --out a folder": (["front", "--table", "{d}/t.json", "--out", "{d}"], table_file, None),
        "front --out blank": (["front", "--table", "{d}/t.json", "--out", " "], table_file, None),
        "front --out /proc": (["front", "--table", "{d}/t.json", "--out", "/proc/gap-bench/f.csv"], table_file, None),
        "prune --out a foreign folder": (
            ["prune", "--model", "{fx}/tiny-llama", "--uniform", "0.1", "--criterion", "magnitude", "--out", "{d}/thesis"],
            write("thesis/thesis.tex", "precious"),
            None,
        ),
        "prune --out an existing file": (
            ["prune", "--model", "{fx}/tiny-llama", "--uniform", "0.1", "--criterion", "magnitude", "--out", "{d}/notes.txt"],
            write("notes.txt", "keep"),
            None,
        ),
    }
    return [Case(name, "outputs", argv, prepare, cwd=cwd) for name, (argv, prepare, cwd) in raw.items()]


def environment_cases() -> list[Case]:
    cases = []
    commands = {
        "models": ["models"],
        "cache ls": ["cache", "ls"],
        "table": ["table", "--model", "{fx}/tiny-llama", "--samples", "2", "--seq-len", "16", "--out", "{d}/t.json"],
        "eval builtin": ["eval", "--model", "smollm2-135m", "--samples", "2", "--seq-len", "16"],
        "report --run": ["report", "--table", "{d}/absent.json", "--run", "1", "--out", "{d}/r.html"],
    }
    for where, value, prepare in (
        ("a file", "{d}/cachefile", write("cachefile", "x")),
        ("under a file", "{d}/cachefile/sub", write("cachefile", "x")),
        ("a FIFO", "{d}/cachefifo", fifo("cachefifo")),
    ):
        for name, argv in commands.items():
            cases.append(Case(f"GAP_CACHE_DIR {where} ({name})", "environment", argv, prepare, env={"GAP_CACHE_DIR": value}))
    hub = {
        "hub id offline (table)": [
            "table",
            "--model",
            "nobody-here/no-such-model",
            "--samples",
            "2",
            "--seq-len",
            "16",
            "--out",
            "{d}/t.json",
        ],
        "hub id offline (eval)": ["eval", "--model", "nobody-here/no-such-model"],
        "hub id malformed": ["eval", "--model", "bad id/x y"],
        "unknown builtin smollm2-153m": ["table", "--model", "smollm2-153m", "--samples", "2", "--seq-len", "16", "--out", "{d}/t.json"],
        "gguf file absent": ["eval", "--model", "{d}/absent.gguf"],
        "model a FIFO": ["eval", "--model", "{d}/pipe"],
        "model /dev/zero": ["eval", "--model", "/dev/zero"],
        "model a folder without config": ["eval", "--model", "{d}"],
    }
    for name, argv in hub.items():
        cases.append(Case(name, "environment", argv, fifo("pipe") if "FIFO" in name else None, env={"HF_HUB_OFFLINE": "1"}))
    for name, argv in (("converted copy a FIFO (models)", ["models"]), ("converted copy a FIFO (models --verify)", ["models", "--verify"])):

        def prepare(d: Path) -> None:
            folder = d / "cache" / "models" / "smollm2-135m"
            folder.mkdir(parents=True)
            (folder / "gap_converted.json").write_text(json.dumps({"builtin": "smollm2-135m", "files": {}}))
            os.mkfifo(folder / "model.safetensors")

        cases.append(Case(name, "environment", argv, prepare, env={"GAP_CACHE_DIR": "{d}/cache"}, expect="ok"))
    return cases


def disk_cases() -> list[Case]:
    limit = 64 * 1024  # the tiny model's weights are ~25 MB: any save passes it
    small = 512  # a table, front or report file is a few kB
    raw = {
        "prune": (["prune", "--model", "{fx}/tiny-llama", "--uniform", "0.5", "--criterion", "magnitude", "--out", "{d}/out/pruned"], None),
        "prune dp checkpoint again": (
            ["prune", "--model", "{fx}/dp", "--uniform", "0.2", "--criterion", "magnitude", "--out", "{d}/out/pruned"],
            None,
        ),
        "export hf": (["export", "{fx}/ck", "--format", "hf", "--dtype", "float32", "--out", "{d}/out/hf"], None),
        "export gguf": (["export", "{fx}/ck", "--out", "{d}/out/m.gguf"], None),
        "recover": (
            [
                "recover",
                "--model",
                "{fx}/ck",
                "--method",
                "mezo",
                "--steps",
                "1",
                "--data",
                "news-sample",
                "--seq-len",
                "16",
                "--batch-size",
                "1",
                "--pool-windows",
                "2",
                "--no-eval-before",
                "--no-dense",
                "--no-history",
                "--eval-samples",
                "1",
                "--eval-seq-len",
                "16",
                "--generations",
                "0",
                "--out",
                "{d}/out/rec",
            ],
            None,
        ),
        "table": (
            [
                "table",
                "--model",
                "{fx}/tiny-llama",
                "--estimator",
                "fisher",
                "--samples",
                "2",
                "--seq-len",
                "16",
                "--rates",
                "0,0.5",
                "--no-cache",
                "--out",
                "{d}/out/t.json",
            ],
            None,
        ),
        "front": (
            ["front", "--table", "{d}/t.json", "--n-buckets", "200000", "--out", "{d}/out/f.csv"],
            write("t.json", _table_text("extras", {})),
        ),
        "report": (
            ["report", "--table", "{d}/t.json", "--budget", "0.2", "--out", "{d}/out/r.html"],
            write("t.json", _table_text("extras", {})),
        ),
    }
    cases = []
    for name, (argv, prepare) in raw.items():
        step = both(prepare, lambda d: (d / "out").mkdir()) if prepare else (lambda d: (d / "out").mkdir())
        cases.append(
            Case(
                f"full disk during {name}",
                "full disk",
                argv,
                step,
                file_limit=small if name in ("table", "report") else 64 if name == "front" else limit,
            )
        )
    return cases


def history_cases() -> list[Case]:
    values = {
        "plan nested": ("plan_json", "[" * DEEP + "]" * DEEP),
        "plan truncated": ("plan_json", "{x"),
        "plan a list": ("plan_json", "[1]"),
        "perplexity text": ("perplexity_json", json.dumps({"news-sample": "high"})),
        "perplexity list": ("perplexity_json", "[1]"),
        "generations object": ("generations_json", "{}"),
        "budget text": ("budget", "a lot"),
        "params 1e300": ("pruned_params", 1e300),
        "params text": ("dense_params", "many"),
        "model a blob": ("model", b"\xff\x00"),
        "plan 400 digits": ("plan_json", '{"num_layers": ' + BIG_INT + "}"),
        "plan not json": ("plan_json", "\xff"),
    }
    cases = []
    for name, (column, value) in values.items():

        def prepare(d: Path, column=column, value=value) -> None:
            (d / "t.json").write_text(_table_text("extras", {}))
            os.environ["GAP_CACHE_DIR"] = str(d / "cache")
            from gap_engine.evaluate import history

            run_id = history.record_run(
                history.RunRecord(model="tiny-llama", allocator="manual", plan=plan_dict(), perplexity={"news-sample": 10.0})
            )
            with sqlite3.connect(history.history_path()) as conn:
                conn.execute(f"UPDATE runs SET {column} = ? WHERE id = ?", (value, run_id))

        cases.append(
            Case(
                f"history row {name}",
                "history",
                ["report", "--table", "{d}/t.json", "--run", "1", "--out", "{d}/r.html"],
                prepare,
                env={"GAP_CACHE_DIR": "{d}/cache"},
            )
        )
    cases.append(
        Case(
            "history file not a database",
            "history",
            ["report", "--table", "{d}/t.json", "--run", "1", "--out", "{d}/r.html"],
            both(write("t.json", _table_text("extras", {})), write("cache/runs/history.sqlite", "not sqlite")),
            env={"GAP_CACHE_DIR": "{d}/cache"},
        )
    )
    return cases


def recover_state_cases() -> list[Case]:
    """Tampered resume state: a run's OUT.partial/state/state.json (``recover --resume``)."""
    base = [
        "recover",
        "--model",
        "{fx}/ck",
        "--method",
        "mezo",
        "--steps",
        "4",
        "--data",
        "news-sample",
        "--seq-len",
        "16",
        "--batch-size",
        "1",
        "--pool-windows",
        "2",
        "--no-eval-before",
        "--no-dense",
        "--no-history",
        "--eval-samples",
        "1",
        "--eval-seq-len",
        "16",
        "--generations",
        "0",
        "--resume",
        "--out",
        "{d}/rec",
    ]
    changes = {
        "step 1000000": {"step": 1_000_000},
        "step -1": {"step": -1},
        "step text": {"step": "3"},
        "unknown field": {"x": 1},
        "curve a dict": {"curve": {}},
        "version 9": {"version": 9},
        "trajectory a list": {"trajectory": []},
    }
    cases = []
    for name, change in changes.items():

        def prepare(d: Path, change=change) -> None:
            folder = d / "rec.partial" / "state"
            folder.mkdir(parents=True)
            state = {
                "trajectory": {"steps": 4},
                "start_fingerprint": "x",
                "step": 2,
                "train_seconds": 0.0,
                "curve": [],
                "before": None,
                "calib_before": [],
                "inference_rss": 0,
                "peak_rss": 0,
                "rss_method": "",
                "version": 1,
            }
            (folder / "state.json").write_text(json.dumps(state | change))
            (folder / "tensors.safetensors").write_bytes(b"\x00" * 16)

        cases.append(Case(f"resume state {name}", "resume", base, prepare))
    cases.append(
        Case(
            "resume state a FIFO",
            "resume",
            base,
            both(lambda d: (d / "rec.partial" / "state").mkdir(parents=True), fifo("rec.partial/state/state.json")),
        )
    )
    return cases


def issue34_meaning_cases() -> list[Case]:
    """The i34 families read for meaning (saved files, numbers, inputs, links): bench/hostile_meaning.py, given this module."""
    return hostile_meaning.cases(sys.modules[__name__])


def all_cases() -> list[Case]:
    return (
        table_cases()
        + plan_cases()
        + option_cases()
        + checkpoint_cases()
        + text_cases()
        + output_cases()
        + environment_cases()
        + disk_cases()
        + history_cases()
        + recover_state_cases()
        + issue34_cases()
        + issue34_meaning_cases()
        + hostile_rules_and_identity.cases(sys.modules[__name__])
        + hostile_declared.cases(sys.modules[__name__])
    )


def issue34_cases() -> list[Case]:
    """The i34 families of foreign code, outputs, paths and output hygiene: bench/hostile_code_and_paths.py, given this module."""
    from hostile_code_and_paths import cases

    return cases(sys.modules[__name__])


# ---- running and classifying ------------------------------------------------------------------
def _fill(value: str, folder: Path) -> str:
    return str(value).replace("{d}", str(folder)).replace("{fx}", str(FIXTURES))


def _snapshot(folder: Path) -> dict:
    """sha256 of every regular file under ``folder`` (the case's inputs)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        try:
            if path.is_file() and not path.is_symlink():
                out[path.relative_to(folder).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
    return out


def run_case(case: Case, folder: Path, timeout: float) -> dict:
    from gap_engine.cli import main

    folder.mkdir(parents=True)
    env = {k: _fill(v, folder) for k, v in case.env.items()}
    if case.prepare:
        saved = dict(os.environ)
        case.prepare(folder)
        os.environ.clear()
        os.environ.update(saved)
    before = _snapshot(folder)
    argv = [_fill(a, folder) for a in case.argv]
    # Pipes, not files, carry the child's output: RLIMIT_FSIZE (a full disk) limits files only.
    err_read, err_write = os.pipe()
    out_read, out_write = os.pipe()
    in_read, in_write = os.pipe()  # the child's stdin: open and silent until the case ends
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: one gap command, then _exit (no atexit, no pytest)
        code = 99
        try:
            os.close(err_read)
            os.close(out_read)
            os.close(in_write)
            os.environ.update(env)
            if "GAP_CACHE_DIR" not in env:
                os.environ["GAP_CACHE_DIR"] = str(CACHE)
            os.chdir(folder / case.cwd if case.cwd else folder)
            if case.cwd_gone:
                os.rmdir(os.getcwd())
            if case.file_limit:
                resource.setrlimit(resource.RLIMIT_FSIZE, (case.file_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            if case.stderr_to:
                os.dup2(os.open(case.stderr_to, os.O_WRONLY), 2)
            else:
                os.dup2(err_write, 2)
            os.dup2(out_write, 1)
            if case.stdin_open:
                os.dup2(in_read, 0)
                sys.stdin = os.fdopen(0, "r")
            sys.stderr = os.fdopen(2, "w", buffering=1)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            try:
                link = argv[:1] == [hostile_meaning.LINK]  # an explorer link (AppTest), not a gap command
                code = hostile_meaning.open_link(argv[1:]) if link else main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 2
            sys.stderr.flush()
            sys.stdout.flush()
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 98
        finally:
            os._exit(code)
    os.close(err_write)
    os.close(out_write)
    os.close(in_read)
    chunks = {err_read: [], out_read: []}

    def drain(fd: int) -> None:
        while True:
            data = os.read(fd, 65536)
            if not data:
                break
            chunks[fd].append(data)
        os.close(fd)

    readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in chunks]
    for reader in readers:
        reader.start()
    status = None
    while time.perf_counter() - started < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        status = None
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    for reader in readers:
        reader.join(5)
    os.close(in_write)
    seconds = time.perf_counter() - started
    hung = status is None
    code = None if hung else os.waitstatus_to_exitcode(status)
    err_bytes, out_bytes = b"".join(chunks[err_read]), b"".join(chunks[out_read])
    err_text = err_bytes.decode(errors="replace")
    err_lines = [line for line in err_text.splitlines() if line.strip()]
    after = _snapshot(folder)
    destroyed = sorted(name for name, digest in before.items() if after.get(name) != digest)
    foreign = sorted(str(p.relative_to(folder)) for pattern in case.absent for p in folder.glob(pattern))
    if hung:
        verdict = "hang"
    elif case.marker and (folder / case.marker).exists():
        verdict = "code executed"
    elif b"[y/N]" in out_bytes + err_bytes:
        verdict = "prompted"
    elif destroyed:
        verdict = "input destroyed"
    elif foreign:
        verdict = "foreign write"
    elif code == 70:
        verdict = "internal error"
    elif any(ch in out_bytes + err_bytes for ch in (b"\x1b", b"\x07", b"\x08")):
        verdict = "unsafe output"  # a control character reached the terminal
    elif case.stderr_to:
        verdict = "clean" if code == (0 if case.expect == "ok" else 2) else "unclean"
    elif case.expect == "ok":
        wrong = case.verify(folder) if code == 0 and case.verify else None
        verdict = "wrong success" if wrong else "clean" if code == 0 else "unclean"
        err_lines = [wrong] if wrong else err_lines
    elif code == 0:
        verdict = "wrong success"
    elif code == 2 and len(err_lines) == 1 and ERROR_LINE.match(err_lines[0]):
        verdict = "clean"
    elif code == 2 and err_lines and ERROR_LINE.match(err_lines[-1]) and not any(NOT_PROGRESS.search(line) for line in err_lines[:-1]):
        verdict = "clean after work"  # the error needed the model (a fingerprint, a token count): its progress lines come first
    else:
        verdict = "unclean"
    if verdict in CLEAN and case.says and _fill(case.says, folder) not in err_lines[-1]:
        verdict = "wrong message"
    return {
        "name": case.name,
        "family": case.family,
        "verdict": verdict,
        "code": code,
        "seconds": round(seconds, 2),
        "lines": len(err_lines),
        "first": (err_lines[-1] if err_lines else "")[:200],
        "destroyed": (destroyed or foreign)[:3],
        "pending": case.pending,
    }


def _build_fixture_tree(base: Path, build: Callable[[Path], None] | None = None) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            os.environ["GAP_CACHE_DIR"] = str(CACHE)
            (build or build_fixtures)(base)
            os._exit(0)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("building the fixtures failed")


CACHE = Path()
CLEAN = ("clean", "clean after work")


def _warm_up(work: Path) -> None:
    """One valid run of each kind in this process, so every child inherits the imports
    (transformers builds its lazy modules on first use: ~25 s) and the parsed built-in texts.
    Torch runs single-threaded, so no thread pool exists to break in the forked children."""
    import contextlib
    import io

    import torch

    from gap_engine.cli import main

    torch.set_num_threads(1)
    os.environ["GAP_CACHE_DIR"] = str(CACHE)
    runs = [
        [
            "eval",
            "--model",
            str(FIXTURES / "ck"),
            "--no-dense",
            "--no-throughput",
            "--generations",
            "0",
            "--data",
            "news-sample,wiki-sample",
            "--samples",
            "2",
            "--seq-len",
            "16",
        ],
        ["export", str(FIXTURES / "ck"), "--out", str(work / "warm.gguf")],
        ["front", "--table", str(work / "warm.json"), "--out", str(work / "warm.csv")],
    ]
    (work / "warm.json").write_text(_table_text("extras", {}))
    for argv in runs:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(argv)
    import logging

    from gap_engine.data import windows

    windows._load_builtin.cache_clear()  # children read (and log) the built-in texts themselves, as a fresh gap does
    logging.getLogger().handlers.clear()  # each child's main() sets up its own, on its own stderr
    del os.environ["GAP_CACHE_DIR"]


def write_report(results: list[dict], out: Path, argv: list[str], seconds: float, load: str, machine: str) -> None:
    verdicts = [
        "clean",
        "clean after work",
        "internal error",
        "hang",
        "wrong success",
        "input destroyed",
        "code executed",
        "prompted",
        "foreign write",
        "unsafe output",
        "unclean",
        "wrong message",
    ]
    families = sorted({r["family"] for r in results}, key=lambda f: [r["family"] for r in results].index(f))
    lines = [
        "# Hostile inputs against the `gap` command line (issue 24)",
        "",
        f"Command: `{command_line(SCRIPT, argv)}`",
        "",
        f"{len(results)} cases in {seconds:.0f} s wall on this machine (load average before the run: {load}); "
        "each case a forked child of one process that imported the engine once, with its own folder and a time limit.",
        "",
        machine,
        "",
        "| family | tried | " + " | ".join(verdicts) + " |",
        "|---|---:|" + "---:|" * len(verdicts),
    ]
    for family in families + ["all"]:
        rows = [r for r in results if family in ("all", r["family"])]
        counts = [sum(r["verdict"] == v for r in rows) for v in verdicts]
        label = "**all**" if family == "all" else family
        lines.append(f"| {label} | {len(rows)} | " + " | ".join(str(c) for c in counts) + " |")
    clean = sum(r["verdict"] in CLEAN for r in results)
    lines += [
        "",
        f"Clean: {clean} of {len(results)} ({100 * clean / max(len(results), 1):.1f}%). "
        "Clean means exit 2 with exactly one `gap: error:` line for bad input (exit 0 for the valid controls), "
        'no input file changed, within the time limit; "clean after work" is the same line preceded only by the '
        "command's own progress lines, for inputs whose fault shows only once the model is loaded "
        "(a table made for other weights, a text too short for one window in this tokenizer, a full disk).",
        "",
    ]
    pending = [r for r in results if r["pending"]]
    if pending:
        lines += [
            "## Cases waiting on another branch",
            "",
            "Expected to be clean only once what they wait on is merged; they do not fail the run until then.",
            "",
            "| case | waits on | verdict |",
            "|---|---|---|",
        ]
        lines += [f"| {r['name'].replace('|', '/')} | {r['pending']} | {r['verdict']} |" for r in pending]
        lines.append("")
    bad = [r for r in results if r["verdict"] not in CLEAN]
    if bad:
        lines += ["## Cases that were not clean", "", "| case | verdict | exit | lines | last stderr line |", "|---|---|---:|---:|---|"]
        for r in bad:
            lines.append(f"| {r['name']} | {r['verdict']} | {r['code']} | {r['lines']} | {r['first'].replace('|', '/')} |")
        lines.append("")
    lines += ["## Every case", "", "| family | case | verdict | exit | s | stderr line |", "|---|---|---|---:|---:|---|"]
    for r in results:
        lines.append(
            f"| {r['family']} | {r['name'].replace('|', '/')} | {r['verdict']} | {r['code']} | {r['seconds']} | {r['first'][:120].replace('|', '/')} |"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, with_header("\n".join(lines), SCRIPT, argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hostile.md")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--only", help="run only cases whose name contains this")
    parser.add_argument("--family", help="run only cases whose family starts with this (e.g. 'i34')")
    return parser


def main(argv: list[str] | None = None) -> int:
    global FIXTURES, CACHE
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]
    load_start = os.getloadavg()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: F401 - imported once here, before the forks

    import gap_engine.cli.export_commands
    import gap_engine.cli.model_commands
    import gap_engine.cli.plan_commands
    import gap_engine.cli.recover_commands
    import gap_engine.cli.report_commands
    import gap_engine.cli.table_commands  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="gap-hostile-"))
    CACHE = work / "cache"
    builtin = ROOT / "cache" / "models"
    if builtin.is_dir():  # the converted built-in models, linked (not converted again per case)
        (CACHE / "models").mkdir(parents=True)
        for entry in builtin.iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                (CACHE / "models" / entry.name).symlink_to(entry)
    FIXTURES = work / "fixtures"
    FIXTURES.mkdir()
    started = time.perf_counter()
    _build_fixture_tree(FIXTURES)
    _build_fixture_tree(FIXTURES, hostile_meaning.build_fixtures)
    _build_fixture_tree(FIXTURES, hostile_rules_and_identity.build_fixtures)
    _warm_up(work)
    cases = [c for c in all_cases() if (not args.only or args.only in c.name) and (not args.family or c.family.startswith(args.family))]
    results = []
    for i, case in enumerate(cases):
        result = run_case(case, work / "cases" / f"c{i:04d}", args.timeout)
        results.append(result)
        mark = "" if result["verdict"] in CLEAN else f"  <-- {result['verdict']}: {result['first'][:100]}"
        mark += f"  (pending: {case.pending})" if case.pending else ""
        print(f"[{i + 1}/{len(cases)}] {case.family}: {case.name} ({result['seconds']} s){mark}", flush=True)
    seconds = time.perf_counter() - started
    write_report(results, args.out, argv, seconds, " ".join(load), machine_line(load_start, started))
    shutil.rmtree(work, ignore_errors=True)
    clean = sum(r["verdict"] in CLEAN for r in results)
    waiting = sum(r["verdict"] not in CLEAN and bool(r["pending"]) for r in results)
    print(
        f"{clean}/{len(results)} clean" + (f" ({waiting} not clean wait on another branch)" if waiting else "") + f"; report in {args.out}"
    )
    return 0 if clean + waiting == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
