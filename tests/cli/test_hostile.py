"""Hostile and careless input against the command line and the explorer.

Every case asserts the guarantees docs/errors-and-limits.md states: exit
status 2, exactly one line on stderr (``gap: error: ...``, logging included), no traceback,
nothing written at ``--out``; where the input is a bomb, that memory stays bounded (Python
allocations measured with tracemalloc in-process, and the peak RSS of a subprocess against
a harmless refusal). Positive controls show that the valid twin of each input works, so a
refusal is the input's fault, not a broken fixture.

Everything runs on a tiny two-layer model, a synthetic loss table written by hand and
small files; the built-in model is used only for the tokenizer and, in the one slow test,
to check that a damaged converted copy is converted again.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

# fresh_cache: an empty GAP_CACHE_DIR with the built-in model linked in; start: AppTest on a page.
# cached_table: the app tests' tiny table of the built-in model, stored in fresh_cache.
from app_fixtures import cached_table, fresh_cache, start, tiny_table  # noqa: F401 - fixtures and a helper shared with the app tests

from gap_engine.cli import main
from gap_engine.core.limits import LIMITS, SizeLimits

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
BOMB_PEAK_BYTES = 20 * MiB  # Python allocations while a bomb is refused (a 9-level alias bomb expands to 10^9 items)


# ---- running the CLI -----------------------------------------------------------------------------
class _LiveStderr(logging.Handler):
    """Log records to whatever sys.stderr is now (capsys's), so log lines count as stderr lines."""

    def emit(self, record):
        sys.stderr.write(self.format(record) + "\n")


@pytest.fixture
def cli(capsys, tmp_path, monkeypatch):
    """Run ``gap`` in-process: returns (exit status, stderr lines); checks the shared guarantees."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GAP_FORCE_SIZE", raising=False)
    handler = _LiveStderr(logging.INFO)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)

    def run(argv: list[str]) -> tuple[int, list[str], str]:
        capsys.readouterr()
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        captured = capsys.readouterr()
        return code, [line for line in captured.err.splitlines() if line.strip()], captured.out

    yield run
    root.removeHandler(handler)
    root.setLevel(old_level)


def assert_refused(result, message: str, out: Path | None = None, before: set | None = None) -> str:
    """Exit 2, one stderr line naming the problem, no traceback, nothing at ``out``."""
    code, err, _ = result
    assert code == 2, (code, err)
    assert len(err) == 1, err
    line = err[0]
    assert "Traceback" not in line and "error:" in line, line
    assert message.lower() in line.lower(), line
    if out is not None:
        assert not out.exists(), f"{out} was written"
        if before is not None:
            assert set(out.parent.iterdir()) == before, set(out.parent.iterdir()) ^ before
    return line


_RUN_AND_REPORT_PEAK = (
    "import atexit, os, sys\n"
    "def report():\n"
    "    peak = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]\n"
    "    open(os.environ['GAP_TEST_PEAK_FILE'], 'w').write(peak)\n"
    "atexit.register(report)\n"
    "from gap_engine.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def run_subprocess(argv: list, tmp_path: Path) -> tuple[int, str, int]:
    """(exit status, stderr, peak RSS in bytes) of ``gap argv`` in a fresh process.

    The peak is the process's own high-water mark (VmHWM, reset by exec), so the memory of
    the forking test process is not counted.
    """
    peak_file = tmp_path / f"peak-{os.getpid()}-{len(list(tmp_path.iterdir()))}"
    env = os.environ | {"PYTHONPATH": str(ROOT), "GAP_TEST_PEAK_FILE": str(peak_file)}
    env.pop("GAP_FORCE_SIZE", None)
    result = subprocess.run(
        [sys.executable, "-c", _RUN_AND_REPORT_PEAK, *map(str, argv)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    return result.returncode, result.stderr, int(peak_file.read_text()) * 1024


def peak_python_bytes(fn) -> int:
    """Peak Python allocations while ``fn`` runs (the command modules imported beforehand)."""
    import gap_engine.cli.model_commands
    import gap_engine.cli.plan_commands  # noqa: F401

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---- hostile files --------------------------------------------------------------------------------
def write_input(tmp_path: Path, name: str, content) -> Path:
    """``content`` (text or bytes) in ``tmp_path/inputs/name``."""
    path = tmp_path / "inputs" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def work_out(tmp_path: Path, name: str) -> Path:
    """An output path in an empty ``tmp_path/work`` folder."""
    (tmp_path / "work").mkdir(exist_ok=True)
    return tmp_path / "work" / name


def yaml_alias_bomb(levels: int = 9) -> str:
    """The billion-laughs pattern as one flow list: each level holds ten aliases of the one before.

    At 7 levels these 462 bytes made a 319 MB plan.json and a 1.8 GB peak before the fix.
    """
    parts = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    parts += [f"&a{i} [" + ",".join(f"*a{i - 1}" for _ in range(10)) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def plan_dict(num_layers: int = 2) -> dict:
    return {
        "model": "smollm2-135m",
        "model_fingerprint": None,
        "num_layers": num_layers,
        "criterion": "magnitude",
        "attention_rates": [0.25] * num_layers,
        "mlp_rates": [0.25] * num_layers,
        "channel_multiple": 8,
        "params": {},
        "allocator": "manual",
        "budget": 0.25,
        "predicted_loss": None,
        "table_key": None,
        "created": "2026-11-30T12:00:00+00:00",
        "format_version": 2,
    }


def _bomb_plan() -> str:
    """A plan whose ``model`` field is an alias bomb."""
    fields = "\n".join(f"{k}: {json.dumps(v)}" for k, v in plan_dict().items() if k != "model")
    return f"model: {yaml_alias_bomb(9)}\n{fields}\n"


DEEP = 200_000
PLAN_CASES = {
    # name: (file name, content (str or bytes), message)
    "yaml-alias-bomb-in-model": ("plan.yaml", _bomb_plan(), "alias"),
    "yaml-alias-bomb-document": ("plan.yaml", yaml_alias_bomb(9), "alias"),
    "yaml-alias-bomb-no-suffix": ("plan.txt", _bomb_plan(), "alias"),
    "yaml-merge-key-alias": ("plan.yaml", "base: &b {model: x}\nplan:\n  <<: *b\n", "alias"),
    "json-nested-200k": ("plan.json", "[" * DEEP + "]" * DEEP, "deeper than"),
    "yaml-nested-200k": ("plan.yaml", "[" * DEEP + "]" * DEEP, "deeper than"),
    "json-truncated": ("plan.json", json.dumps(plan_dict())[:-40], "is not valid json"),
    "json-truncated-no-suffix": ("plan.txt", json.dumps(plan_dict())[:-40], "is not valid json"),
    "model-is-a-list": ("plan.json", json.dumps(plan_dict() | {"model": ["a", ["b"]]}), "plan model must be a text"),
    "model-10k-chars": ("plan.json", json.dumps(plan_dict() | {"model": "m" * 10_000}), "at most 512 characters"),
    "model-with-newline": ("plan.json", json.dumps(plan_dict() | {"model": "a\nTraceback (most recent call last):"}), "printable"),
    "num-layers-1e999": ("plan.json", json.dumps(plan_dict()).replace('"num_layers": 2', '"num_layers": 1e999'), "integer"),
    "num-layers-text": ("plan.json", json.dumps(plan_dict() | {"num_layers": "2"}), "integer"),
    "num-layers-huge": ("plan.json", json.dumps(plan_dict() | {"num_layers": 10**12}), "num_layers must be between"),
    "rate-is-text": ("plan.json", json.dumps(plan_dict() | {"mlp_rates": [0.1, "0.1"]}), "outside [0, 1)"),
    "rate-is-bool": ("plan.json", json.dumps(plan_dict() | {"attention_rates": [True, 0.1]}), "outside [0, 1)"),
    "budget-nan": (
        "plan.yaml",
        "budget: .nan\n" + "\n".join(f"{k}: {json.dumps(v)}" for k, v in plan_dict().items() if k != "budget"),
        "finite",
    ),
    "params-nested": ("plan.json", json.dumps(plan_dict() | {"params": {"removed": {"a": [1]}}}), "must be a number"),
    "created-is-a-date": (
        "plan.yaml",
        "created: 2025-01-01\n" + "\n".join(f"{k}: {json.dumps(v)}" for k, v in plan_dict().items() if k != "created"),
        "date or time",
    ),
    "python-object-tag": ("plan.yaml", "model: !!python/object/apply:os.system ['echo pwned']\n", "tags are not allowed"),
    "non-text-key": ("plan.yaml", "1: one\nmodel: x\n", "key that is not text"),
    "not-utf8": ("plan.json", b"\xff\xfe{\x00\x00}", "not utf-8"),
    "empty-file": ("plan.yaml", "", "must be a json/yaml object"),
    "above-size-limit": ("plan.json", json.dumps(plan_dict() | {"pad": "x" * (2 * MiB)}), "above the limit"),
}


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_hostile_plan_files_are_one_line_refusals(cli, tmp_path, name):
    file_name, content, message = PLAN_CASES[name]
    plan_path, out = write_input(tmp_path, file_name, content), work_out(tmp_path, "pruned")
    assert_refused(cli(["prune", "--model", "smollm2-135m", "--plan", plan_path, "--out", out]), message, out, set())


def test_a_plan_that_is_a_folder_is_refused(cli, tmp_path):
    out = tmp_path / "pruned"
    assert_refused(cli(["prune", "--model", "smollm2-135m", "--plan", tmp_path, "--out", out]), "it is a folder", out)


@pytest.mark.parametrize("name", ["yaml-alias-bomb-in-model", "yaml-alias-bomb-document", "json-nested-200k", "yaml-nested-200k"])
@pytest.mark.slow
def test_plan_bombs_are_refused_before_they_take_memory(tmp_path, name):
    from gap_engine.core.errors import PlanError
    from gap_engine.model.rateplan import RatePlan

    file_name, content, message = PLAN_CASES[name]

    def parse():
        with pytest.raises(PlanError, match=message):
            RatePlan.from_text(content, hint=file_name)

    assert peak_python_bytes(parse) < BOMB_PEAK_BYTES


@pytest.mark.heavy
def test_yaml_bomb_subprocess_rss_matches_a_harmless_refusal(tmp_path):
    """Peak RSS of `gap prune --plan bomb.yaml` equals that of a plan with an unknown criterion."""
    bomb, harmless = tmp_path / "bomb.yaml", tmp_path / "harmless.yaml"
    bomb.write_text(_bomb_plan())
    harmless.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in (plan_dict() | {"criterion": "psychic"}).items()))
    results = {}
    for label, path in (("bomb", bomb), ("harmless", harmless)):
        code, err, rss = run_subprocess(["prune", "--model", "smollm2-135m", "--plan", path, "--out", tmp_path / label], tmp_path)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / label).exists()
        assert ("alias" if label == "bomb" else "psychic") in err, err
        results[label] = rss
    assert results["bomb"] - results["harmless"] < 64 * MiB, results


# ---- loss tables -----------------------------------------------------------------------------------
def table_dict() -> dict:
    """A valid two-layer split loss table (rates 0 and 0.5), written by hand: no model needed."""
    from gap_engine.core.config import WindowSpec
    from gap_engine.tables.artefact import TableSpec

    spec = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", rate_grid=(0.0, 0.5))
    return {
        "format_version": 2,
        "key": "tiny-nll-split-taylor-0123456789abcdef0123",
        "model": "tiny-llama",
        "model_fingerprint": "0123456789abcdef",
        "num_layers": 2,
        "spec": spec.to_dict(),
        "data_fingerprint": "f" * 64,
        "components": [[0, "attn"], [0, "mlp"], [1, "attn"], [1, "mlp"]],
        "rate_grid": [0.0, 0.5],
        "dense_objective": 3.5,
        "dense_prunable": 40_000,
        "build_seconds": 1.0,
        "delta": [[0.0, 0.2], [0.0, 0.4], [0.0, -0.01], [0.0, 0.3]],
        "smoothed": [[0.0, 0.2], [0.0, 0.4], [0.0, 0.0], [0.0, 0.3]],
        "cell_objective": [[3.5, 3.7], [3.5, 3.9], [3.5, 3.49], [3.5, 3.8]],
        "removed": [[0, 4_000], [0, 6_000], [0, 4_000], [0, 6_000]],
        "extras": {},
        "window_start": "bos",
        "measured": [[True, False]] * 4,
        "cell_tokens": None,
        "estimate": None,
    }


def _with(path: str, value):
    """A mutation setting one field (``spec.seq_len`` style paths) of the table."""

    def mutate(d):
        target = d
        *parents, last = path.split(".")
        for key in parents:
            target = target[key]
        target[last] = value
        return json.dumps(d)

    return mutate


TABLE_CASES = {
    "num-layers-1e999": (lambda d: json.dumps(d).replace('"num_layers": 2', '"num_layers": 1e999'), "num_layers must be an integer"),
    "window-start-list": (_with("window_start", ["bos"] * 3), "window_start"),
    "measured-nested-objects": (_with("measured", [[{"a": 1}, True]] * 4), "malformed loss table"),
    "format-version-1": (_with("format_version", 1), "format version 1 is not supported"),
    "num-layers-billion": (_with("num_layers", 10**9), "num_layers must be between"),
    "num-layers-disagrees-with-rows": (_with("num_layers", 3), "components must list 6 rows"),
    "dense-prunable-zero": (_with("dense_prunable", 0), "dense_prunable must be between"),
    "dense-prunable-negative": (_with("dense_prunable", -5_308_416_000), "dense_prunable must be between"),
    "smoothed-negative": (_with("smoothed", [[0.0, 0.2], [0.0, -0.4], [0.0, 0.0], [0.0, 0.3]]), "below 0"),
    "removed-1e30": (_with("removed", [[0, 1e30], [0, 6_000], [0, 4_000], [0, 6_000]]), "more than its dense_prunable"),
    "removed-fraction": (_with("removed", [[0, 4000.5], [0, 6_000], [0, 4_000], [0, 6_000]]), "not a whole number"),
    "removed-negative": (_with("removed", [[0, -4000], [0, 6_000], [0, 4_000], [0, 6_000]]), "below 0"),
    "delta-text": (_with("delta", [[0.0, "x"], [0.0, 0.4], [0.0, 0.0], [0.0, 0.3]]), "must be a number"),
    "delta-infinite": (lambda d: json.dumps(d).replace("0.4]", "1e999]", 1), "finite"),
    "spec-seq-len-billion": (_with("spec.seq_len", 10**9), "above the limit"),
    "spec-samples-text": (_with("spec.n_samples", "2"), "must be an integer"),
    "model-name-nested": (_with("model", {"a": ["b"]}), "model must be a text"),
    "nested-200k": (lambda d: "[" * DEEP + "]" * DEEP, "deeper than"),
    "truncated": (lambda d: json.dumps(d)[:-30], "not valid json"),
    "not-utf8": (lambda d: b"\xff" + json.dumps(d).encode(), "not utf-8"),
}


@pytest.fixture
def front_run(cli, tmp_path):
    def run(table_text, *extra):
        table_path, out = write_input(tmp_path, "table.json", table_text), work_out(tmp_path, "front.csv")
        return cli(["front", "--table", table_path, "--out", out, *extra]), out

    return run


def test_the_synthetic_table_is_valid(front_run):
    (code, err, out_text), out = front_run(json.dumps(table_dict()))
    assert code == 0, err
    assert out.read_text().startswith("budget,")


@pytest.mark.parametrize("name", list(TABLE_CASES))
def test_tables_that_make_no_sense_are_refused(front_run, name):
    mutate, message = TABLE_CASES[name]
    result, out = front_run(mutate(copy.deepcopy(table_dict())))
    assert_refused(result, message, out, set())


def test_a_table_file_past_its_size_limit_is_refused_unread(cli, tmp_path):
    big = tmp_path / "inputs" / "big.json"
    big.parent.mkdir()
    with open(big, "wb") as handle:
        handle.truncate(LIMITS.table_bytes + 1)  # sparse: costs no disk
    out = tmp_path / "work" / "front.csv"
    out.parent.mkdir()
    result = []
    peak = peak_python_bytes(lambda: result.append(cli(["front", "--table", big, "--out", out])))
    assert_refused(result[0], "above the limit", out, set())
    assert peak < BOMB_PEAK_BYTES, peak  # refused from its size, not read


# ---- gap report's inputs ------------------------------------------------------------------------------
def eval_report_dict() -> dict:
    """What `gap eval --json` prints, trimmed to the fields a report shows."""
    return {
        "model": "tiny-pruned",
        "params": 30_000,
        "perplexity": {"news-sample": 12.5},
        "dense": {"params": 40_000, "perplexity": {"news-sample": 10.0}},
        "kl_to_dense": {"news-sample": 0.1},
        "top1_agreement": {"news-sample": 0.8},
        "throughput": {"prefill_speedup": 1.2, "decode_speedup": 1.1},
        "generations": [{"prompt": "The", "model": "The end", "dense": "The start"}],
    }


REPORT_EVAL_CASES = {
    "nested-200k": (lambda d: "[" * DEEP + "]" * DEEP, "deeper than"),
    "truncated": (lambda d: json.dumps(d)[:-20], "not valid json"),
    "not-an-evaluation": (lambda d: json.dumps(table_dict()), "not an evaluation report"),
    "perplexity-a-list": (lambda d: json.dumps(d | {"perplexity": {"news-sample": [1]}}), "must be a number"),
    "perplexity-infinite": (lambda d: json.dumps(d).replace("12.5", "1e999"), "finite"),
    "dense-a-list": (lambda d: json.dumps(d | {"dense": []}), "dense must be an object"),
    "params-text": (lambda d: json.dumps(d | {"params": "many"}), "params must be an integer"),
    "generations-a-number": (lambda d: json.dumps(d | {"generations": 5}), "generations must be a list"),
    "generation-text-a-list": (lambda d: json.dumps(d | {"generations": [{"prompt": ["x"]}]}), "prompt must be a text"),
    "above-size-limit": (lambda d: json.dumps(d | {"pad": "x" * (2 * MiB)}), "above the limit"),
}


@pytest.fixture
def report_run(cli, tmp_path):
    """``gap report`` of the synthetic table with a plan for it and the given evaluation file."""

    def run(eval_text):
        table = write_input(tmp_path, "table.json", json.dumps(table_dict()))
        plan = write_input(tmp_path, "plan.json", json.dumps(plan_dict() | {"model": "tiny-llama"}))
        evaluation, out = write_input(tmp_path, "eval.json", eval_text), work_out(tmp_path, "report.html")
        return cli(["report", "--table", table, "--plan", plan, "--eval", evaluation, "--out", out]), out

    return run


@pytest.mark.slow
def test_a_valid_evaluation_makes_a_report(report_run):
    (code, err, _), out = report_run(json.dumps(eval_report_dict()))
    assert code == 0, err
    assert "12.5" in out.read_text()


@pytest.mark.parametrize("name", list(REPORT_EVAL_CASES))
def test_hostile_evaluation_files_for_a_report_are_one_line_refusals(report_run, name):
    mutate, message = REPORT_EVAL_CASES[name]
    result, out = report_run(mutate(eval_report_dict()))
    assert_refused(result, message, out, set())


# ---- resource-sized arguments ---------------------------------------------------------------------
SIZE_CASES = {
    "eval-seq-len-100000": (["eval", "--model", "smollm2-135m", "--seq-len", "100000"], "--seq-len 100,000"),
    "front-n-buckets-1e8": (["front", "--table", "t.json", "--n-buckets", "100000000"], "--n-buckets 100,000,000"),
    "table-samples-100000": (["table", "--samples", "100000"], "--samples 100,000"),
    "window-tokens": (["eval", "--model", "smollm2-135m", "--samples", "64", "--seq-len", "4096"], "262,144 tokens"),
    "batch-tokens": (["eval", "--model", "smollm2-135m", "--samples", "64", "--seq-len", "1024", "--batch-size", "64"], "one forward pass"),
    "batch-size": (["table", "--batch-size", "100000", "--samples", "4", "--seq-len", "16"], "--batch-size 100,000"),
    "rates-300": (["table", "--rates", ",".join(str(i / 300) for i in range(300))], "300 rates"),
    "budgets-100": (["compare", "--model", "smollm2-135m", "--budgets", ",".join(["0.1"] * 100)], "100 budgets"),
    "evo-generations": (
        ["plan", "--table", "t.json", "--budget", "0.2", "--allocator", "evo", "--evo-generations", "1000000"],
        "--evo-generations 1,000,000",
    ),
    "evo-offspring": (
        ["plan", "--table", "t.json", "--budget", "0.2", "--allocator", "evo", "--evo-offspring", "100000"],
        "--evo-offspring 100,000",
    ),
    "generations": (["eval", "--model", "smollm2-135m", "--generations", "1000"], "--generations 1,000"),
    "compare-eval-seq-len": (["compare", "--model", "smollm2-135m", "--eval-seq-len", "100000"], "--eval-seq-len 100,000"),
    "channel-multiple-huge": (
        ["prune", "--model", "smollm2-135m", "--uniform", "0.1", "--channel-multiple", "1000000"],
        "--channel-multiple",
    ),
    "prune-rounds-1000": (["prune", "--model", "smollm2-135m", "--budget", "0.2", "--rounds", "1000"], "--rounds 1,000"),
    "prune-rounds-0": (["prune", "--model", "smollm2-135m", "--budget", "0.2", "--rounds", "0"], "--rounds must be at least 1"),
    "refine-budgets-100": (
        ["table", "--estimator", "refine", "--refine-budgets", ",".join(["0.1"] * 100)],
        "--refine-budgets lists 100 budgets",
    ),
    "ray-workers-10000": (["table", "--ray", "--ray-workers", "10000"], "--ray-workers 10,000"),
    "seq-len-1": (["eval", "--model", "smollm2-135m", "--seq-len", "1"], "--seq-len must be at least 2"),
    "samples-0": (["table", "--samples", "0"], "--samples must be at least 1"),
    "seed-negative": (["eval", "--model", "smollm2-135m", "--seed", "-1"], "--seed must be at least 0"),
    "channel-multiple-0": (["prune", "--model", "smollm2-135m", "--uniform", "0.1", "--channel-multiple", "0"], "at least 1"),
    "keep-params-0": (["plan", "--table", "t.json", "--keep-params", "0"], "--keep-params must be at least 1"),
    "data-empty": (["eval", "--model", "smollm2-135m", "--data", ""], "--data names no text source"),
    "data-commas": (["eval", "--model", "smollm2-135m", "--data", " , ,"], "--data names no text source"),
    "eval-data-empty": (["compare", "--model", "smollm2-135m", "--eval-data", ""], "--eval-data names no text source"),
    "uniform-2": (["prune", "--model", "smollm2-135m", "--uniform", "2"], "outside [0, 1)"),
    "unknown-option": (["eval", "--model", "smollm2-135m", "--sequence-length", "5"], "unrecognized arguments"),
    "bad-choice-with-newline": (["table", "--estimator", "exact\nsecond line"], "invalid choice"),
}


@pytest.mark.parametrize("name", list(SIZE_CASES))
def test_resource_sized_and_bad_arguments_are_refused_before_work(cli, tmp_path, name):
    argv, message = SIZE_CASES[name]
    work = tmp_path / "work"
    work.mkdir()
    out = work / ("pruned" if argv[0] == "prune" else "out.json" if argv[0] == "table" else "out.csv")
    if argv[0] not in ("eval",):
        argv = argv + ["--out", out]

    result = []
    peak = peak_python_bytes(lambda: result.append(cli(argv)))  # refused before anything is allocated for the size
    assert_refused(result[0], message, out, set())
    assert peak < BOMB_PEAK_BYTES, peak


def test_force_size_lets_a_size_past_its_ceiling_through(front_run):
    result, _ = front_run(json.dumps(table_dict()), "--n-buckets", str(LIMITS.n_buckets + 1))
    assert_refused(result, "--force-size")
    (code, err, _), out = front_run(json.dumps(table_dict()), "--n-buckets", str(LIMITS.n_buckets + 1), "--force-size")
    assert code == 0, err and out.is_file()


@pytest.mark.slow
def test_n_buckets_bomb_subprocess_stays_small(tmp_path):
    code, err, rss = run_subprocess(
        ["front", "--table", tmp_path / "t.json", "--out", tmp_path / "f.csv", "--n-buckets", "100000000"], tmp_path
    )
    assert code == 2 and err.count("\n") == 1 and "--force-size" in err, err
    assert rss < 100 * MiB, rss  # the parser alone; refused before torch is even imported
    assert not (tmp_path / "f.csv").exists()


# ---- text sources --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, smol_tokenizer):
    """A plain Hugging Face folder holding a tiny random Llama and the SmolLM2 tokenizer."""
    from conftest import tiny_lm

    lm = tiny_lm("llama", smol_tokenizer)
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    lm.model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


def _jsonl(lines):
    return "\n".join(lines) + "\n"


GOOD_DOC = json.dumps({"text": "A plain sentence about pruning that is long enough to be a document. " * 4})
TEXT_CASES = {
    "jsonl-nested-200k": ("docs.jsonl", _jsonl([GOOD_DOC, '{"text": "x", "meta": ' + "[" * DEEP + "]" * DEEP + "}"]), "line 2 nests"),
    "jsonl-line-is-a-list": ("docs.jsonl", _jsonl([GOOD_DOC, '["not", "an", "object"]']), "line 2"),
    "jsonl-truncated-line": ("docs.jsonl", _jsonl([GOOD_DOC, '{"text": "unterminated']), "line 2 is not valid json"),
    "txt-not-utf8": ("docs.txt", b"\xff\xfe\x00bad bytes\n", "not utf-8"),
    "txt-empty": ("docs.txt", "\n\n  \n", "empty"),
}


@pytest.mark.parametrize("name", list(TEXT_CASES))
def test_hostile_text_sources_are_one_line_refusals(cli, tmp_path, tiny_model_dir, name):
    file_name, content, message = TEXT_CASES[name]
    source, out = write_input(tmp_path, file_name, content), work_out(tmp_path, "table.json")
    argv = [
        "table",
        "--model",
        tiny_model_dir,
        "--data",
        source,
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
        out,
    ]
    assert_refused(cli(argv), message, out, set())


def test_a_text_file_past_its_size_limit_is_refused_unread(cli, tmp_path, tiny_model_dir):
    source = tmp_path / "huge.txt"
    with open(source, "wb") as handle:
        handle.truncate(LIMITS.text_bytes + 1)  # sparse
    out = tmp_path / "work" / "table.json"
    out.parent.mkdir()
    argv = [
        "table",
        "--model",
        tiny_model_dir,
        "--data",
        source,
        "--estimator",
        "fisher",
        "--samples",
        "2",
        "--seq-len",
        "16",
        "--no-cache",
        "--out",
        out,
    ]
    assert_refused(cli(argv), "above the limit", out, set())


# ---- outputs -------------------------------------------------------------------------------------
def test_prune_out_onto_an_existing_file_is_refused_and_the_file_kept(cli, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    line = assert_refused(cli(["prune", "--model", "smollm2-135m", "--uniform", "0.1", "--out", target]), "is an existing file")
    assert target.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], line


@pytest.mark.parametrize(
    "command, out_of, message",
    [
        ("prune", lambda t: t / "afile" / "pruned", "is a file, not a folder"),
        ("table", lambda t: t / "afile" / "deeper" / "t.json", "is a file, not a folder"),
        ("front", lambda t: Path("/proc/gap-hostile-test/f.csv"), "cannot be written"),
        ("front", lambda t: t, "is a folder"),
        ("table", lambda t: Path("/dev/null"), "not a regular file"),
        ("prune", lambda t: t / "full-folder", "neither empty nor a gap checkpoint"),
        ("front", lambda t: Path(" "), "is empty"),
        ("report", lambda t: t / "afile" / "report.html", "is a file, not a folder"),
        ("report", lambda t: t / "full-folder", "is a folder"),
    ],
    ids=[
        "prune-under-a-file",
        "table-under-a-file",
        "front-read-only",
        "front-onto-a-folder",
        "table-onto-a-device",
        "prune-onto-a-foreign-folder",
        "front-blank-path",
        "report-under-a-file",
        "report-onto-a-folder",
    ],
)
def test_unwritable_outputs_are_found_before_the_work(cli, tmp_path, command, out_of, message):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full-folder").mkdir()
    (tmp_path / "full-folder" / "thesis.tex").write_text("precious")
    out = out_of(tmp_path)
    before = set(tmp_path.iterdir())
    args = {
        "prune": ["prune", "--model", "smollm2-135m", "--uniform", "0.1"],
        "table": ["table", "--samples", "2", "--seq-len", "16"],
        "front": ["front", "--table", tmp_path / "absent.json"],
        "report": ["report", "--table", tmp_path / "absent.json"],
    }[command]
    assert_refused(cli(args + ["--out", out]), message)
    assert set(tmp_path.iterdir()) == before
    assert (tmp_path / "full-folder" / "thesis.tex").read_text() == "precious"


CACHE_USERS = {
    "cache-ls": lambda t: ["cache", "ls"],
    "models": lambda t: ["models"],
    "table": lambda t: ["table", "--samples", "2", "--seq-len", "16", "--out", t / "work" / "t.json"],
    "eval-builtin": lambda t: ["eval", "--model", "smollm2-135m", "--samples", "2", "--seq-len", "16"],
    "report-run": lambda t: ["report", "--table", t / "absent.json", "--run", "1", "--out", t / "work" / "r.html"],
}


@pytest.mark.parametrize("command", list(CACHE_USERS))
@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_gap_cache_dir_that_is_not_a_folder_is_one_line(cli, tmp_path, monkeypatch, where, command):
    """Refused before anything else is done (no text source read, no log line first)."""
    afile = tmp_path / "cachefile"
    afile.write_text("x")
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("GAP_CACHE_DIR", str(afile if where == "a-file" else afile / "sub"))
    assert_refused(cli(CACHE_USERS[command](tmp_path)), "cache root")
    assert afile.read_text() == "x" and list((tmp_path / "work").iterdir()) == []


def test_the_preflight_knows_every_builtin_model():
    from gap_engine.cli.preflight import BUILTIN_NAMES
    from gap_engine.model.loading import BUILTIN_MODELS

    assert set(BUILTIN_NAMES) == set(BUILTIN_MODELS)


def test_stale_temporaries_of_a_killed_writer_are_removed(front_run, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    work = tmp_path / "work"
    work.mkdir()
    stale_dir = work / f".front.csv.{dead.pid}-abc123.tmp"
    stale_dir.mkdir()
    (stale_dir / "part").write_bytes(b"x" * 1000)
    live = work / f".front.csv.{os.getpid()}-def456.tmp"  # a write of this process in progress
    live.write_text("busy")
    (code, err, _), out = front_run(json.dumps(table_dict()))
    assert code == 0, err
    assert out.is_file() and not stale_dir.exists() and live.exists()


@pytest.mark.slow
def test_a_killed_prune_leaves_a_temporary_checkpoint_the_next_prune_removes(cli, tmp_path, tiny_model_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    work = tmp_path / "work"
    stale = work / f".pruned.{dead.pid}-k1ll3d.tmp"  # what atomic_directory leaves when kill -9 hits a save
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\0" * 100_000)
    code, err, _ = cli(["prune", "--model", tiny_model_dir, "--uniform", "0.5", "--criterion", "magnitude", "--out", work / "pruned"])
    assert code == 0, err
    assert sorted(p.name for p in work.iterdir()) == ["pruned"]
    assert (work / "pruned" / "gap_pruned.json").is_file()


def test_a_disk_that_fills_up_half_way_is_one_line_and_leaves_nothing(front_run, tmp_path, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the write itself fails, after the checks passed
    result, out = front_run(json.dumps(table_dict()))
    assert_refused(result, "No space left on device", out, set())


def test_a_checkpoint_save_that_fills_the_disk_leaves_no_folder(tmp_path):
    import errno

    from gap_engine.core.errors import OutputError
    from gap_engine.core.fsutil import atomic_directory

    target = tmp_path / "ckpt"
    with pytest.raises(OutputError, match="No space left"):
        with atomic_directory(target) as tmp:
            (tmp / "model.safetensors").write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_outputs_follow_the_umask(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, stat
        os.umask(0o027)
        from gap_engine.core import fsutil
        fsutil.atomic_write_text({str(tmp_path / "file.txt")!r}, "x")
        with fsutil.atomic_directory({str(tmp_path / "folder")!r}) as tmp:
            (tmp / "inner.json").write_text("{{}}")
        modes = [stat.S_IMODE(os.stat(p).st_mode) for p in ({str(tmp_path / "file.txt")!r}, {str(tmp_path / "folder")!r}, {str(tmp_path / "folder" / "inner.json")!r})]
        print(" ".join(oct(m) for m in modes))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0o640", "0o750", "0o640"]


def test_cache_rm_removes_the_lock_file(cli, tmp_path):
    from gap_engine.tables import cache
    from gap_engine.tables.artefact import LossTable

    table = LossTable.from_json(json.dumps(table_dict()))
    folder = cache.put_table(table)
    with cache.lock(table.key):
        pass
    lock_file = folder.with_name(folder.name + ".lock")
    assert lock_file.exists()
    code, err, _ = cli(["cache", "rm", table.key])
    assert code == 0, err
    assert not folder.exists() and not lock_file.exists()


@pytest.mark.parametrize(
    "meta",
    ["[1, 2]", "[" * DEEP + "]" * DEEP, '{"key": "other"}', "\xff", '{"key": "%s", "table_sha256": 5}'],
    ids=["list", "nested-200k", "another-key", "not-utf8", "bad-checksum-type"],
)
def test_corrupt_cache_entries_are_skipped_by_cache_ls(cli, tmp_path, meta):
    from gap_engine.tables import cache
    from gap_engine.tables.artefact import LossTable

    table = LossTable.from_json(json.dumps(table_dict()))
    folder = cache.put_table(table)
    (folder / "meta.json").write_bytes(meta.replace("%s", table.key).encode("latin-1"))
    code, err, out = cli(["cache", "ls", "--json"])
    assert code == 0 and err == [] and json.loads(out) == []
    assert cache.get_table(table.key) is None  # and the entry is discarded, never used


# ---- partial cells ---------------------------------------------------------------------------------
def test_partial_cells_carry_a_checksum(tmp_path, monkeypatch):
    from gap_engine.tables.cache import PartialCells

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    store = PartialCells("tiny-key-1")
    store.save({(0, 1): (0.5, "units-a"), (1, 1): (0.25, "units-b")})
    assert store.load() == {(0, 1): (0.5, "units-a"), (1, 1): (0.25, "units-b")}
    store.path.write_text(store.path.read_text().replace("0.5", "0.75"))
    assert store.load() == {} and not store.path.exists()


@pytest.mark.slow
def test_a_changed_partial_cell_is_measured_again_not_sealed(tmp_path, monkeypatch, smol_tokenizer):
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.data.windows import calibration_windows
    from gap_engine.tables.artefact import TableSpec
    from gap_engine.tables.build import measure_table
    from gap_engine.tables.cache import PartialCells

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    lm = tiny_lm("llama", smol_tokenizer)
    spec = TableSpec(
        windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="exact", criterion="magnitude", rate_grid=(0.0, 0.5)
    )
    windows = calibration_windows(lm.tokenizer, spec.windows)
    store = PartialCells("tiny-exact-key")
    first = measure_table(lm, spec, windows, partial=store, key="tiny-exact-key")
    saved = json.loads(store.path.read_text())
    saved["cells"][0][2] += 100.0  # an edited measurement
    store.path.write_text(json.dumps(saved))
    second = measure_table(lm, spec, windows, partial=store, key="tiny-exact-key")
    assert second.extras["cells_resumed"] == 0
    assert abs(second.delta - first.delta).max() < 1e-9  # the edit never reached the table


# ---- checkpoints -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smol_tokenizer):
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.rateplan import uniform_plan
    from gap_engine.pipeline.stages import prune_with_plan

    lm = tiny_lm("llama", smol_tokenizer)
    plan = uniform_plan(lm, 0.5, "magnitude")
    result = prune_with_plan(lm, plan, WindowSpec(n_samples=2, seq_len=16))
    return save_pruned(lm, plan, result.kept_indices(), tmp_path_factory.mktemp("ckpt") / "tiny-pruned")


def _edit_json(name, change):
    def edit(folder: Path):
        path = folder / name
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return edit


def _write(name, content):
    return lambda folder: (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())


def _pop_layer(data):
    del data["per_layer_config"]["1"]


CHECKPOINT_CASES = {
    "kv-heads-zero-in-config": (_edit_json("config.json", lambda d: d.update(num_key_value_heads=0)), "does not build a model"),
    "kv-heads-zero-in-layer": (
        _edit_json("config.json", lambda d: d["per_layer_config"]["0"].update(num_key_value_heads=0)),
        "num_key_value_heads must be between",
    ),
    "heads-text": (_edit_json("config.json", lambda d: d["per_layer_config"]["0"].update(num_attention_heads="two")), "must be an integer"),
    "kv-does-not-divide": (
        _edit_json("config.json", lambda d: d["per_layer_config"]["0"].update(num_attention_heads=3, num_key_value_heads=2)),
        "do not split",
    ),
    "layer-entry-missing": (_edit_json("config.json", _pop_layer), "no entry for layer 1"),
    "layer-count-disagrees": (_edit_json("config.json", lambda d: d.update(num_hidden_layers=3)), "no entry for layer 2"),
    "layer-extra-entry": (
        _edit_json("config.json", lambda d: d["per_layer_config"].update({"2": d["per_layer_config"]["0"]})),
        "num_hidden_layers is 2",
    ),
    "model-type-list": (_edit_json("config.json", lambda d: d.update(model_type=["llama"])), "unknown model_type"),
    "config-nested-200k": (_write("config.json", "[" * DEEP + "]" * DEEP), "deeper than"),
    "config-2mb": (_write("config.json", json.dumps({"pad": "x" * (2 * MiB)})), "above the limit"),
    "marker-not-json": (_write("gap_pruned.json", "{format_version: 1"), "not valid json"),
    "marker-a-list": (_write("gap_pruned.json", "[1]"), "does not hold a json object"),
    "marker-base-model-list": (_edit_json("gap_pruned.json", lambda d: d.update(base_model=["a"] * 5)), "base_model must be a text"),
    "marker-format-text": (_edit_json("gap_pruned.json", lambda d: d.update(format_version="1")), "format_version must be an integer"),
    "tokenizer-damaged": (_write("tokenizer.json", '{"version": "1.0", "truncated'), "tokenizer files cannot be read"),
    "plan-bomb-inside": (_write("plan.json", "[" * DEEP + "]" * DEEP), "deeper than"),
}


@pytest.mark.slow
def test_the_tiny_checkpoint_evaluates(cli, tiny_checkpoint):
    code, err, out = cli(
        [
            "eval",
            "--model",
            tiny_checkpoint,
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
            "--json",
        ]
    )
    assert code == 0, err
    assert json.loads(out)["perplexity"]["news-sample"] > 1


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_edited_checkpoints_are_one_line_refusals(cli, tmp_path, tiny_checkpoint, name):
    edit, message = CHECKPOINT_CASES[name]
    folder = tmp_path / "edited"
    shutil.copytree(tiny_checkpoint, folder)
    edit(folder)
    argv = [
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
    assert_refused(cli(argv), message)


# ---- the converted built-in model ------------------------------------------------------------------
@pytest.fixture
def damaged_builtin(tmp_path, monkeypatch):
    """A private cache whose smollm2-135m copy links the shared files but holds a truncated model.safetensors."""
    from gap_engine.core.fsutil import cache_root
    from gap_engine.model.loading import load_model

    shared = cache_root() / "models" / "smollm2-135m"
    if not (shared / "gap_converted.json").is_file():
        load_model("smollm2-135m")  # converts it into the shared cache once, as any first use does
    assert (shared / "gap_converted.json").is_file()
    folder = tmp_path / "cache" / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    for path in shared.iterdir():
        if path.name != "model.safetensors":
            (folder / path.name).symlink_to(path)
    with open(shared / "model.safetensors", "rb") as src:
        (folder / "model.safetensors").write_bytes(src.read(1 * MiB))
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    return folder


@pytest.mark.slow  # copies the real built-in model's converted files
def test_gap_models_tells_the_truth_about_a_truncated_copy(damaged_builtin, cli):
    code, err, out = cli(["models", "--json"])
    assert code == 0, err
    row = next(r for r in json.loads(out)["builtin"] if r["name"] == "smollm2-135m")
    assert row["converted"] is False and "model.safetensors" in row["problem"], row
    code, err, out = cli(["models"])
    assert "damaged" in next(line for line in out.splitlines() if line.startswith("smollm2-135m"))


@pytest.mark.slow
@pytest.mark.heavy
def test_a_truncated_converted_model_is_converted_again(damaged_builtin):
    from gap_engine.model.loading import converted_problem, load_model

    lm = load_model("smollm2-135m")  # de-quantizes the GGUF again (20-60 s)
    assert lm.num_layers == 30
    assert not damaged_builtin.is_symlink() and converted_problem(damaged_builtin, full=True) is None
    marker = json.loads((damaged_builtin / "gap_converted.json").read_text())
    assert marker["files"]["model.safetensors"]["bytes"] > 100 * MiB


# ---- the explorer (AppTest) ---------------------------------------------------------------------------
APP_PLAN_UPLOADS = {
    "yaml-alias-bomb": ("plan.yaml", _bomb_plan(), "alias"),
    "json-nested-200k": ("plan.json", "[" * DEEP + "]" * DEEP, "deeper than"),
    "yaml-nested-200k": ("plan.yaml", "[" * DEEP + "]" * DEEP, "deeper than"),
    "json-truncated": ("plan.json", json.dumps(plan_dict())[:-40], "is not valid JSON"),
    "model-is-a-list": ("plan.json", json.dumps(plan_dict() | {"model": [["x"] * 3] * 3}), "model must be a text"),
    "num-layers-1e999": ("plan.json", json.dumps(plan_dict()).replace('"num_layers": 2', '"num_layers": 1e999'), "integer"),
    "not-utf8": ("plan.json", b"\xff\xfe\x00{}", "not UTF-8"),
    "python-tag": ("plan.yaml", "model: !!python/object/apply:os.system ['echo pwned']\n", "tags are not allowed"),
    "above-size-limit": ("plan.json", json.dumps(plan_dict() | {"pad": "x" * (2 * MiB)}), "above the limit"),
}


@pytest.mark.usefixtures("fresh_cache")
@pytest.mark.parametrize("name", list(APP_PLAN_UPLOADS))
@pytest.mark.slow
def test_app_plan_upload_refuses_hostile_files(name):
    file_name, content, message = APP_PLAN_UPLOADS[name]
    at = start("explorer/export.py")
    data = content if isinstance(content, bytes) else content.encode()
    at.file_uploader(key="export_plan_upload").set_value((file_name, data, "application/octet-stream"))
    peak = peak_python_bytes(at.run)
    assert not at.exception, [e.value for e in at.exception]
    errors = [str(e.value) for e in at.error]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in errors[0], errors
    assert "\n" not in errors[0]
    assert not at.session_state["app_uploaded_plan"]
    assert peak < 200 * MiB, peak  # one rerun of the app, the bomb unexpanded


APP_TEXT_UPLOADS = {
    "jsonl-nested-200k": ("docs.jsonl", _jsonl([GOOD_DOC, '{"text": "x", "m": ' + "[" * DEEP + "]" * DEEP + "}"]), "nests"),
    "jsonl-line-is-a-list": ("docs.jsonl", _jsonl([GOOD_DOC, "[1, 2]"]), "line 2"),
    "txt-not-utf8": ("docs.txt", b"\xff\xfe\x00 bad bytes\n", "not UTF-8"),
    "above-size-limit": ("docs.txt", b"word " * 1000, "above the limit"),
}


@pytest.mark.usefixtures("fresh_cache")
@pytest.mark.parametrize("name", list(APP_TEXT_UPLOADS))
@pytest.mark.slow
def test_app_calibration_upload_refuses_hostile_files(monkeypatch, name):
    import gap_engine.core.limits

    file_name, content, message = APP_TEXT_UPLOADS[name]
    if name == "above-size-limit":  # the page reads the ceiling at each run: a 4 kB one stands in for 64 MB
        monkeypatch.setattr(gap_engine.core.limits, "LIMITS", SizeLimits(upload_bytes=4096))
    at = start()
    at.radio(key="setup_data_kind").set_value("Uploaded file").run()
    data = content if isinstance(content, bytes) else content.encode()
    at.file_uploader(key="setup_upload").set_value((file_name, data, "text/plain")).run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [str(e.value) for e in at.error]
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], errors
    assert at.session_state["setup_uploaded_path"] == ""
    uploads = Path(os.environ["GAP_CACHE_DIR"]) / "uploads"
    if name == "above-size-limit":
        assert not uploads.exists() or not any(uploads.iterdir())  # refused before it was stored


@pytest.mark.parametrize(
    "samples, seq_len, batch, message",
    [(512, 4096, 4, "Calibration samples x Tokens per sample"), (8, 4096, 64, "tokens in one forward pass")],
    ids=["window-tokens", "batch-tokens"],
)
@pytest.mark.usefixtures("fresh_cache")
@pytest.mark.slow
def test_app_setup_refuses_sizes_past_the_ceilings(samples, seq_len, batch, message):
    at = start()
    at.number_input(key="setup_samples").set_value(samples)
    at.number_input(key="setup_seq_len").set_value(seq_len)
    at.number_input(key="setup_batch").set_value(batch)
    at.button(key="setup_build").click().run()
    assert not at.exception
    errors = [str(e.value) for e in at.error]
    assert any(message in e for e in errors), errors
    assert "table" not in at.session_state["app_jobs"]


@pytest.mark.usefixtures("fresh_cache")
@pytest.mark.slow
def test_app_setup_refuses_a_rate_grid_past_the_ceiling():
    at = start()
    at.text_input(key="setup_rate_grid").set_value(",".join(f"{i / 1000:.3f}" for i in range(LIMITS.rates + 1)))
    at.button(key="setup_build").click().run()
    assert not at.exception
    errors = [str(e.value) for e in at.error]
    assert any(f"Rates lists {LIMITS.rates + 1} rates, which is above the limit of {LIMITS.rates}" in e for e in errors), errors
    assert "table" not in at.session_state["app_jobs"]


@pytest.mark.slow
@pytest.mark.usefixtures("cached_table")
def test_app_evaluate_refuses_held_out_sizes_past_the_ceilings():
    at = start("explorer/evaluate.py")
    at.number_input(key="eval_samples").set_value(256)
    at.number_input(key="eval_seq_len").set_value(2048)  # 524,288 tokens: the widgets' maxima, 4x the ceiling
    at.button(key="eval_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [str(e.value) for e in at.error]
    assert len(errors) == 1 and "Held-out samples x Tokens per sample = 524,288 tokens" in errors[0] and "\n" not in errors[0], errors
    assert "prune_eval" not in at.session_state["app_jobs"]


@pytest.mark.usefixtures("fresh_cache")
@pytest.mark.slow
def test_app_survives_corrupt_cache_entries():
    from gap_engine.tables import cache
    from gap_engine.tables.artefact import LossTable

    table = LossTable.from_json(json.dumps(table_dict()))
    folder = cache.put_table(table)
    (folder / "meta.json").write_text("[" * DEEP + "]" * DEEP)
    at = start()
    assert at.session_state["app_table"] is None
    assert any("holds no finished table" in str(c.value) for c in at.caption)


def test_app_with_gap_cache_dir_a_file_shows_one_line(tmp_path, monkeypatch):
    afile = tmp_path / "cachefile"
    afile.write_text("x")
    monkeypatch.setenv("GAP_CACHE_DIR", str(afile))
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("cache root" in str(e.value) for e in at.error)
    assert afile.read_text() == "x"


# ---- serving -------------------------------------------------------------------------------------------
def test_the_explorer_listens_on_loopback_by_default():
    import tomllib

    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"
    makefile = (ROOT / "Makefile").read_text()
    assert config["server"]["maxUploadSize"] * MiB == LIMITS.upload_bytes  # the server refuses bigger uploads itself
    assert "HOST ?= 127.0.0.1" in makefile and "--server.address $(HOST)" in makefile
    dry = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True)
    assert "--server.address 127.0.0.1" in dry.stdout, dry.stdout + dry.stderr
    opt_in = subprocess.run(["make", "-n", "run", "HOST=0.0.0.0"], cwd=ROOT, capture_output=True, text=True)
    assert "--server.address 0.0.0.0" in opt_in.stdout


# ==== round 2 =======================================================================================
# Each case below guards against an input destroyed, code or markup written into a file, a
# traceback, a hang, or a wrong success.
import resource  # noqa: E402 - the round-2 cases' own imports, kept beside them
import sqlite3  # noqa: E402
import stat  # noqa: E402


@pytest.fixture
def fifo_watchdog():
    """Make a FIFO whose reader, if any, is released after ``seconds``, so a read that blocks
    (inside C code no signal interrupts) ends and the test fails instead of hanging.

    Returns ``make(path, seconds)``; the fixture's ``fired`` list is non-empty when a reader
    had to be released, i.e. the FIFO was opened for reading.
    """
    import threading

    timers = []

    def make(path: Path, seconds: float = 30.0) -> Path:
        os.mkfifo(path)

        def release():
            try:  # succeeds only while a reader has it open; the reader then sees end of file
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                return
            make.fired.append(path)
            os.close(fd)

        timer = threading.Timer(seconds, release)
        timer.daemon = True
        timer.start()
        timers.append(timer)
        return path

    make.fired = []
    yield make
    for timer in timers:
        timer.cancel()


@pytest.fixture
def checkpoint_copy(tmp_path, tiny_checkpoint):
    folder = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, folder)
    return folder


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- 1. one rule for outputs: never an input ---------------------------------------------------
@pytest.mark.parametrize("command", ["plan", "front", "report"])
def test_an_output_that_is_the_table_is_refused_and_the_table_kept(cli, tmp_path, command):
    table = write_input(tmp_path, "t.json", json.dumps(table_dict()))
    before = table.read_bytes()
    argv = {
        "plan": ["plan", "--table", table, "--budget", "0.2", "--model", "smollm2-135m"],
        "front": ["front", "--table", table],
        "report": ["report", "--table", table, "--budget", "0.2"],
    }[command]
    assert_refused(cli(argv + ["--out", table]), "same path as --table")
    assert table.read_bytes() == before


def test_prune_onto_its_own_checkpoint_is_refused_and_the_checkpoint_kept(cli, checkpoint_copy):
    before = _tree(checkpoint_copy)
    assert_refused(
        cli(["prune", "--model", checkpoint_copy, "--uniform", "0.3", "--criterion", "magnitude", "--out", checkpoint_copy]),
        "same path as --model",
    )
    assert _tree(checkpoint_copy) == before


def test_prune_out_dot_inside_the_checkpoint_is_refused_before_work(cli, checkpoint_copy, monkeypatch):
    monkeypatch.chdir(checkpoint_copy)
    before = _tree(checkpoint_copy)
    assert_refused(cli(["prune", "--model", ".", "--uniform", "0.3", "--criterion", "magnitude", "--out", "."]), "same path as --model")
    assert _tree(checkpoint_copy) == before


def test_a_folder_output_that_holds_the_input_is_refused(cli, tmp_path, checkpoint_copy):
    before = _tree(checkpoint_copy)
    assert_refused(
        cli(["prune", "--model", checkpoint_copy, "--uniform", "0.3", "--criterion", "magnitude", "--out", tmp_path]), "holds --model"
    )
    assert _tree(checkpoint_copy) == before


def test_gguf_export_into_the_checkpoint_is_refused_and_the_weights_kept(cli, checkpoint_copy):
    weights = checkpoint_copy / "model.safetensors"
    before = weights.read_bytes()
    assert_refused(cli(["export", checkpoint_copy, "--format", "gguf", "--out", weights]), "inside the checkpoint")
    assert weights.read_bytes() == before


def test_recover_onto_its_own_model_is_refused_before_work(cli, checkpoint_copy):
    before = _tree(checkpoint_copy)
    argv = ["recover", "--model", checkpoint_copy, "--method", "mezo", "--steps", "1", "--out", checkpoint_copy / "sub"]
    assert_refused(cli(argv), "inside --model")
    assert _tree(checkpoint_copy) == before


def test_the_text_source_is_an_input_too(cli, tmp_path):
    text = write_input(tmp_path, "docs.txt", "one document\n\nanother document\n")
    argv = ["table", "--model", "smollm2-135m", "--data", text, "--samples", "2", "--seq-len", "16", "--out", text]
    assert_refused(cli(argv), "same path as --data")
    assert text.read_text() == "one document\n\nanother document\n"


def test_gguf_is_written_through_the_shared_atomic_writer(tmp_path, monkeypatch, smol_tokenizer):
    """Its temporary carries the process id, and the file gets the umask's permissions."""
    from conftest import tiny_lm

    from gap_engine.core import fsutil
    from gap_engine.export import gguf

    seen = []

    def fake_write(lm, config, path, outtype, tokenizer_pre):
        seen.append(Path(path).name)
        Path(path).write_bytes(b"GGUF")
        return gguf.GgufSummary(str(path), outtype, 4, 0, [], [], [], "smollm")

    monkeypatch.setattr(gguf, "_write", fake_write)
    out = tmp_path / "m.gguf"
    gguf.write_gguf(tiny_lm("llama", smol_tokenizer), out)
    assert seen and seen[0].startswith(f".m.gguf.{os.getpid()}-") and seen[0].endswith(".tmp"), seen
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~fsutil._UMASK
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_stale_gguf_temporary_is_removed_by_the_next_export(tmp_path, monkeypatch, smol_tokenizer):
    from conftest import tiny_lm

    from gap_engine.export import gguf

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".m.gguf.{dead.pid}-abcdef.tmp"
    stale.write_bytes(b"half a file")
    monkeypatch.setattr(
        gguf,
        "_write",
        lambda lm, config, path, o, t: (Path(path).write_bytes(b"GGUF"), gguf.GgufSummary(str(path), o, 4, 0, [], [], [], "x"))[1],
    )
    gguf.write_gguf(tiny_lm("llama", smol_tokenizer), tmp_path / "m.gguf")
    assert not stale.exists()


# ---- 2. nothing we write runs code or injects markup --------------------------------------------
HOSTILE_NAME = 'x", trust_remote_code=True); import os; os.system("id")  #'


def _card(folder_name=HOSTILE_NAME, report=None, plan_fields=None):
    from gap_engine.model.model_card import render_model_card
    from gap_engine.model.rateplan import RatePlan

    plan = RatePlan.from_dict(plan_dict() | (plan_fields or {}))
    marker = {
        "base_model": "<img src=x onerror=alert(1)>",
        "widths": [{"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 48}] * 2,
    }
    return render_model_card(
        folder_name, plan, marker, {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}, report
    )


def _code_blocks(card: str, language: str) -> list[str]:
    blocks, inside, current = [], False, []
    for line in card.splitlines():
        if line.startswith("```"):
            if inside:
                blocks.append("\n".join(current))
            inside, current = line == f"```{language}", []
            continue
        if inside:
            current.append(line)
    return blocks


def test_the_model_card_python_snippet_holds_the_name_as_a_string_only():
    import ast

    (snippet,) = _code_blocks(_card(), "python")
    calls = [node for node in ast.walk(ast.parse(snippet)) if isinstance(node, ast.Call)]
    assert [c.func.attr for c in calls] == ["from_pretrained", "from_pretrained"], snippet
    assert all(isinstance(c.args[0], ast.Constant) and c.args[0].value == HOSTILE_NAME for c in calls)
    tokenizer_call = calls[1]
    assert not tokenizer_call.keywords, "the tokenizer line must not ask for remote code"


def test_the_model_card_shell_snippet_quotes_the_name():
    import shlex

    snippet = _code_blocks(_card(), "bash")[0]
    words = shlex.split(snippet.splitlines()[0])
    assert words[:2] == ["gap", "export"] and words[2] == HOSTILE_NAME


def test_the_model_card_escapes_evaluation_fields_and_plan_text():
    report = eval_report_dict() | {
        "perplexity": {"<script>alert(1)</script>|x\nnew row": 12.5},
        "generations": [{"prompt": "<img src=x onerror=alert(2)>", "model": "a | b\n| forged | row |"}],
    }
    card = _card("ok-name", report, {"allocator": "<b onmouseover=alert(3)>", "created": "`code` <i>"})
    assert "<script" not in card and "<img" not in card and "<b " not in card and "<i>" not in card
    assert "| forged |" not in card
    table_rows = [line for line in card.splitlines() if line.startswith("| ") and "12.500" in line]
    assert len(table_rows) == 1 and table_rows[0].count(" | ") == 4, table_rows


@pytest.fixture(scope="module")
def dp_checkpoint(tmp_path_factory, smol_tokenizer):
    """A tiny checkpoint whose blocks keep different head counts (what a DP plan makes)."""
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.rateplan import make_plan
    from gap_engine.pipeline.stages import prune_with_plan

    lm = tiny_lm("llama", smol_tokenizer)
    plan = make_plan(lm, [0.5, 0.0], [0.5, 0.25], "magnitude", allocator="dp")
    result = prune_with_plan(lm, plan, WindowSpec(n_samples=2, seq_len=16))
    return save_pruned(lm, plan, result.kept_indices(), tmp_path_factory.mktemp("dp") / "tiny-dp")


@pytest.mark.slow
def test_a_dp_checkpoint_tokenizer_loads_with_plain_autotokenizer(dp_checkpoint, smol_tokenizer):
    from transformers import AutoTokenizer

    config = json.loads((dp_checkpoint / "config.json").read_text())
    assert config["per_layer_config"]["0"]["num_attention_heads"] != config["per_layer_config"]["1"]["num_attention_heads"]
    tokenizer = AutoTokenizer.from_pretrained(str(dp_checkpoint))
    assert tokenizer("pruning")["input_ids"] == smol_tokenizer("pruning")["input_ids"]


@pytest.mark.slow
def test_a_dp_checkpoint_still_loads_with_its_remote_code_and_in_gap(dp_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    from gap_engine.model.loading import load_model

    ours = load_model(str(dp_checkpoint))
    theirs = AutoModelForCausalLM.from_pretrained(str(dp_checkpoint), trust_remote_code=True, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(ours.model(ids).logits, theirs(ids).logits, atol=1e-4)


@pytest.mark.slow
def test_a_base_model_read_from_a_checkpoint_never_reaches_the_network(cli, checkpoint_copy, monkeypatch):
    from gap_engine.model import loading as models

    calls = []
    real = models._from_folder

    def recording(path, local_only, dtype=None):
        calls.append((path, local_only))
        return real(path, local_only, dtype)

    monkeypatch.setattr(models, "_from_folder", recording)
    marker = json.loads((checkpoint_copy / "gap_pruned.json").read_text())
    (checkpoint_copy / "gap_pruned.json").write_text(json.dumps(marker | {"base_model": "some-org/some-model"}))
    code, err, _ = cli(
        [
            "eval",
            "--model",
            checkpoint_copy,
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
    )
    assert code == 0, err
    assert calls == [], calls  # not in the local hub cache: transformers is not even asked
    assert any("not in the local hub cache" in line for line in err), err


# ---- 3. a full disk (ulimit -f) is one line and leaves nothing -----------------------------------
def assert_failed_after_work(result, message: str) -> None:
    """Exit 2 and one ``gap: error:`` line, the last: a failure after the work legitimately
    started may follow its progress lines, never a traceback."""
    code, err, _ = result
    assert code == 2, (code, err)
    assert err and err[-1].startswith("gap: error:") and message.lower() in err[-1].lower(), err
    assert sum("error" in line.lower() for line in err) == 1 and not any("Traceback" in line for line in err), err


@pytest.fixture
def small_file_limit():
    """RLIMIT_FSIZE at 64 KiB for the body (writes past it fail with EFBIG; Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.slow
def test_prune_on_a_full_disk_is_one_line_and_leaves_nothing(cli, tmp_path, tiny_model_dir, small_file_limit):
    work = tmp_path / "work"
    work.mkdir()
    assert_failed_after_work(
        cli(["prune", "--model", tiny_model_dir, "--uniform", "0.5", "--criterion", "magnitude", "--out", work / "pruned"]),
        "file too large",
    )
    assert list(work.iterdir()) == []


def test_export_hf_on_a_full_disk_is_one_line_and_leaves_nothing(cli, tmp_path, tiny_checkpoint, small_file_limit):
    work = tmp_path / "work"
    work.mkdir()
    assert_failed_after_work(
        cli(["export", tiny_checkpoint, "--format", "hf", "--dtype", "float32", "--out", work / "again"]), "file too large"
    )
    assert list(work.iterdir()) == []


@pytest.mark.slow
def test_recover_on_a_full_disk_is_one_line_and_leaves_no_partial_folder(cli, tmp_path, tiny_checkpoint, small_file_limit):
    work = tmp_path / "work"
    work.mkdir()
    argv = [
        "recover",
        "--model",
        tiny_checkpoint,
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
        work / "recovered",
    ]
    assert_failed_after_work(cli(argv), "file too large")
    assert list(work.iterdir()) == []


# ---- 4. special files are refused, not opened -----------------------------------------------------
def test_a_fifo_for_weights_in_a_checkpoint_is_one_line_not_a_hang(cli, checkpoint_copy, fifo_watchdog):
    (checkpoint_copy / "model.safetensors").unlink()
    fifo_watchdog(checkpoint_copy / "model.safetensors")
    argv = [
        "eval",
        "--model",
        checkpoint_copy,
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
    result = cli(argv)
    assert not fifo_watchdog.fired, "the FIFO was opened for reading"
    assert_refused(result, "model.safetensors is a FIFO")


def test_a_fifo_in_the_converted_models_folder_does_not_hang_gap_models(cli, tmp_path, fifo_watchdog):
    folder = tmp_path / "cache" / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "gap_converted.json").write_text(json.dumps({"builtin": "smollm2-135m", "files": {}}))
    fifo_watchdog(folder / "model.safetensors")
    code, err, out = cli(["models"])
    assert not fifo_watchdog.fired, "the FIFO was opened for reading"
    assert code == 0, err
    assert "damaged: smollm2-135m: model.safetensors is a FIFO" in out.replace(str(folder), "smollm2-135m"), out


@pytest.mark.parametrize("flag", ["--plan", "--data"])
def test_a_fifo_given_as_an_input_file_is_refused(cli, tmp_path, fifo_watchdog, flag):
    fifo = fifo_watchdog(tmp_path / ("plan.json" if flag == "--plan" else "docs.txt"))
    argv = (
        ["prune", "--model", "smollm2-135m", "--uniform", "0.1", "--out", tmp_path / "out"]
        if flag == "--data"
        else ["prune", "--model", "smollm2-135m", "--out", tmp_path / "out"]
    )
    result = cli(argv + [flag, fifo])
    assert not fifo_watchdog.fired, "the FIFO was opened for reading"
    assert_refused(result, "not a regular file")


# ---- 5. every file through validate.py ------------------------------------------------------------
KEPT_CASES = {
    "nested-200k": ("[" * DEEP + "]" * DEEP, "deeper than"),
    "not-utf8": (b"\xff\xfe{}", "not utf-8"),
    "a-list": ("[1, 2]", "must be an object"),
    "truncated": ('{"kept_heads": [[0, 1]', "not valid json"),
    "index-text": (json.dumps({"kept_kv_heads": [["a"]], "kept_heads": [[0]], "kept_channels": [[0]]}), "must be an integer"),
    "index-400-digits": ('{"kept_kv_heads": [[' + "9" * 400 + ']], "kept_heads": [[0]], "kept_channels": [[0]]}', "400 digits"),
}


@pytest.mark.parametrize("name", list(KEPT_CASES))
@pytest.mark.slow
def test_hostile_kept_indices_are_one_line_in_export_hf(cli, tmp_path, checkpoint_copy, name):
    content, message = KEPT_CASES[name]
    (checkpoint_copy / "kept_indices.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "again"
    assert_refused(cli(["export", checkpoint_copy, "--format", "hf", "--out", out]), message, out)


def test_a_hostile_saved_evaluation_is_left_out_of_the_card(tmp_path, checkpoint_copy):
    from gap_engine.model.storage import read_eval_report

    (checkpoint_copy / "eval_report.json").write_text("[" * DEEP + "]" * DEEP)
    assert read_eval_report(checkpoint_copy) is None
    (checkpoint_copy / "eval_report.json").write_text(json.dumps(eval_report_dict() | {"perplexity": {"x": "<script>"}}))
    assert read_eval_report(checkpoint_copy) is None


def _history_with(tmp_path, **columns) -> int:
    from gap_engine.evaluate import history

    run_id = history.record_run(
        history.RunRecord(
            model="tiny-llama", allocator="manual", plan=plan_dict() | {"model": "tiny-llama"}, perplexity={"news-sample": 10.0}
        )
    )
    if columns:
        with sqlite3.connect(history.history_path()) as conn:
            for name, value in columns.items():
                conn.execute(f"UPDATE runs SET {name} = ? WHERE id = ?", (value, run_id))
    return run_id


@pytest.mark.parametrize(
    "column, value, message",
    [
        ("plan_json", "[" * DEEP + "]" * DEEP, "deeper than"),
        ("plan_json", "{truncated", "not valid json"),
        ("perplexity_json", json.dumps({"news-sample": "high"}), "must be a number"),
        ("budget", "a lot", "must be a number"),
        ("pruned_params", 1e300, "must be an integer"),
    ],
    ids=["plan-nested-200k", "plan-truncated", "perplexity-text", "budget-text", "params-1e300"],
)
def test_hostile_history_rows_are_one_line_in_gap_report(cli, tmp_path, monkeypatch, column, value, message):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    run_id = _history_with(tmp_path, **{column: value})
    table = write_input(tmp_path, "t.json", json.dumps(table_dict()))
    out = work_out(tmp_path, "r.html")
    assert_refused(cli(["report", "--table", table, "--run", run_id, "--out", out]), message, out)


def test_a_run_id_past_sqlite_integers_is_one_line(cli, tmp_path):
    table = write_input(tmp_path, "t.json", json.dumps(table_dict()))
    out = work_out(tmp_path, "r.html")
    assert_refused(cli(["report", "--table", table, "--run", "99999999999999999999", "--out", out]), "run id must be between", out)


def test_a_tampered_resume_step_is_refused(tmp_path):
    from gap_engine.recover.files import RecoveryError, RunState, load_state, save_state

    work = tmp_path / "out.partial"
    save_state(work, RunState(trajectory={"steps": 400}, start_fingerprint="abc", step=3), {"w": __import__("torch").zeros(2)}, None)
    state_file = work / "state" / "state.json"
    state_file.write_text(json.dumps(json.loads(state_file.read_text()) | {"step": 1_000_000}))
    with pytest.raises(RecoveryError, match="step must be between 0 and 400"):
        load_state(work)


YAML_PLAN_CASES = {
    "created-2024-02-30": ("created: 2024-02-30", "date or time"),
    "created-hour-25": ("created: 2024-02-01 25:00:00", "date or time"),
    "int-tag-abc": ('budget: !!int "abc"', "tags are not allowed"),
    "float-tag-abc": ('budget: !!float "abc"', "tags are not allowed"),
    "timestamp-tag": ('created: !!timestamp "x"', "tags are not allowed"),
    "bool-tag-maybe": ('budget: !!bool "maybe"', "tags are not allowed"),
    "int-5001-digits": ("num_layers: " + "9" * 5001, "5,001 digits"),
}


@pytest.mark.parametrize("name", list(YAML_PLAN_CASES))
def test_yaml_edge_cases_in_a_plan_are_one_line(cli, tmp_path, name):
    line, message = YAML_PLAN_CASES[name]
    key = line.split(":")[0]
    text = line + "\n" + "\n".join(f"{k}: {json.dumps(v)}" for k, v in plan_dict().items() if k != key)
    plan_path, out = write_input(tmp_path, "plan.yaml", text), work_out(tmp_path, "pruned")
    assert_refused(cli(["prune", "--model", "smollm2-135m", "--plan", plan_path, "--out", out]), message, out, set())


def test_a_400_digit_rate_in_a_json_plan_is_one_line(cli, tmp_path):
    text = json.dumps(plan_dict()).replace('"attention_rates": [0.25, 0.25]', '"attention_rates": [' + "1" * 400 + ", 0.25]")
    plan_path, out = write_input(tmp_path, "plan.json", text), work_out(tmp_path, "pruned")
    assert_refused(cli(["prune", "--model", "smollm2-135m", "--plan", plan_path, "--out", out]), "400 digits", out, set())


ROUND2_TABLE_CASES = {
    "cell-tokens-400-digits": (
        lambda d: json.dumps(d | {"cell_tokens": [[0, 0]] * 4}).replace(
            '"cell_tokens": [[0, 0]', '"cell_tokens": [[' + "9" * 400 + ", 0]", 1
        ),
        "400 digits",
    ),
    "measured-400-digits": (lambda d: json.dumps(d).replace('"measured": [[true', '"measured": [[' + "1" * 400, 1), "400 digits"),
    "estimate-400-digits": (
        lambda d: json.dumps(d | {"estimate": [[0.0, 0.1]] * 4}).replace('"estimate": [[0.0', '"estimate": [[' + "7" * 400, 1),
        "400 digits",
    ),
    "cell-tokens-1e300": (_with("cell_tokens", [[0, 1e300], [0, 16], [0, 16], [0, 16]]), "cell_tokens[0][1]"),
    "layer-index-fraction": (_with("components", [[0, "attn"], [0.7, "mlp"], [1, "attn"], [1, "mlp"]]), "layer must be an integer"),
}


@pytest.mark.parametrize("name", list(ROUND2_TABLE_CASES))
def test_round2_tables_are_refused(front_run, name):
    mutate, message = ROUND2_TABLE_CASES[name]
    result, out = front_run(mutate(copy.deepcopy(table_dict())))
    assert_refused(result, message, out, set())


# ---- 6. preflight: refused before any work, the error the only line ------------------------------
PREFLIGHT_CASES = {
    "unknown-builtin": (["table", "--model", "smollm2-153m", "--samples", "2", "--seq-len", "16"], "unknown model 'smollm2-153m'"),
    "hub-id-offline": (["table", "--model", "nobody-here/no-such-model", "--samples", "2", "--seq-len", "16"], "not reachable (offline)"),
    "hub-id-malformed": (["eval", "--model", "bad id/x y"], "is not a hub id"),
    "data-x-train-offline": (["table", "--data", "x::train", "--samples", "2", "--seq-len", "16"], "not reachable (offline)"),
    "data-unknown-form": (["table", "--data", "not-a-source", "--samples", "2", "--seq-len", "16"], "unknown text source"),
    "data-missing-file": (["table", "--data", "/nonexistent/docs.txt", "--samples", "2", "--seq-len", "16"], "text file not found"),
    "max-memory-lots": (["eval", "--model", "smollm2-135m", "--device-map", "auto", "--max-memory", "cpu=lots"], "'lots' is not a size"),
    "device-map-with-stream": (["eval", "--model", "smollm2-135m", "--device-map", "auto", "--stream"], "leave out --device and --stream"),
    "tokenizer-pre-path": (["export", "smollm2-135m", "--tokenizer-pre", "../../x\ny"], "not a llama.cpp pre-tokenizer name"),
}


@pytest.mark.parametrize("name", list(PREFLIGHT_CASES))
def test_names_and_specs_are_refused_before_any_work(cli, tmp_path, monkeypatch, name):
    from gap_engine.model import loading as models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(models, "_load", no_load)
    argv, message = PREFLIGHT_CASES[name]
    out = ["--out", work_out(tmp_path, "x.gguf" if argv[0] == "export" else "t.json")] if argv[0] in ("table", "export") else []
    assert_refused(cli(argv + out), message)


# ---- 7. the last line of defence ------------------------------------------------------------------
def test_an_unexpected_exception_is_one_line_exit_70_and_a_crash_file(cli, tmp_path, monkeypatch):
    from gap_engine.cli import model_commands

    def broken(args):
        raise ZeroDivisionError("a bug, not the user's input")

    monkeypatch.setattr(model_commands, "run_models", broken)
    code, err, _ = cli(["models"])
    assert code == 70 and len(err) == 1, (code, err)
    assert err[0].startswith("gap: internal error: ZeroDivisionError: a bug") and "details in " in err[0], err
    crash = Path(err[0].rsplit("details in ", 1)[1])
    assert crash.parent == tmp_path / "cache" / "crashes"
    assert "Traceback" in crash.read_text() and "ZeroDivisionError" in crash.read_text()


# ---- 8. smaller items -----------------------------------------------------------------------------
@pytest.mark.slow
def test_recover_onto_its_previous_output_is_not_refused_as_a_file_path(cli, tmp_path, checkpoint_copy):
    """A recover --out that is an earlier output (a checkpoint folder) is replaced, like prune's:
    the refusal of this argv comes from --steps, not from the folder."""
    argv = ["recover", "--model", checkpoint_copy, "--method", "mezo", "--steps", "0", "--out", tmp_path / "previous"]
    shutil.copytree(checkpoint_copy, tmp_path / "previous")
    line = assert_refused(cli(argv), "steps")
    assert "is a folder" not in line, line


def test_log_lines_show_control_characters_as_escapes():
    from gap_engine.cli.main import _PrintableFormatter

    record = logging.LogRecord("gap_engine.data", logging.INFO, __file__, 1, "loaded %s", ("docs\x1b[2J\nINFO forged.txt",), None)
    assert _PrintableFormatter("%(message)s").format(record) == "loaded docs\\x1b[2J\\nINFO forged.txt"


def test_the_cli_installs_the_printable_formatter_on_its_own_handler(tmp_path, monkeypatch, capsys):
    from gap_engine.cli.main import _PrintableFormatter

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        assert main(["cache", "ls", "--json"]) == 0
        ours = [h for h in root.handlers if isinstance(h.formatter, _PrintableFormatter)]
    finally:
        for handler in root.handlers:
            if handler not in saved:
                root.removeHandler(handler)
        root.handlers[:] = saved
    assert len(ours) == 1


# ---- round 3: a checkpoint's files are checked before any text is read -----------------------------
# A text file, not a built-in: a file is read (and its "loaded" line printed) on every run, so a
# check that came after the text read would show as a second line here.
CALIBRATION_TEXT = "".join(f"Document {i}: a plain sentence about pruning, long enough to be a document.\n\n" for i in range(40))

DAMAGED_CHECKPOINTS = {
    "marker-not-json": (_write("gap_pruned.json", "{format_version: 1"), "not valid json"),
    "config-kv-heads-zero": (_edit_json("config.json", lambda d: d.update(num_key_value_heads=0)), "does not build a model"),
    "weights-truncated": (
        lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
        "model.safetensors",
    ),
    "weights-a-folder": (
        lambda f: ((f / "model.safetensors").unlink(), (f / "model.safetensors").mkdir()),
        "model.safetensors is not a regular file",
    ),
    "weights-missing": (lambda f: (f / "model.safetensors").unlink(), "holds no .safetensors file"),
    "tokenizer-damaged": (_write("tokenizer.json", '{"version": "1.0", "truncated'), "tokenizer files cannot be read"),
    "plan-nested": (_write("plan.json", "[" * DEEP + "]" * DEEP), "deeper than"),
}


@pytest.mark.parametrize("name", list(DAMAGED_CHECKPOINTS))
def test_a_damaged_checkpoint_is_refused_before_the_text_is_read(cli, tmp_path, checkpoint_copy, name):
    damage, message = DAMAGED_CHECKPOINTS[name]
    damage(checkpoint_copy)
    docs = write_input(tmp_path, "docs.txt", CALIBRATION_TEXT)
    argv = [
        "eval",
        "--model",
        checkpoint_copy,
        "--no-dense",
        "--no-throughput",
        "--generations",
        "0",
        "--data",
        docs,
        "--samples",
        "2",
        "--seq-len",
        "16",
    ]
    assert_refused(cli(argv), message)


@pytest.mark.parametrize("command", ["prune", "table", "recover", "compare"])
def test_every_command_checks_the_checkpoint_before_the_text(cli, tmp_path, checkpoint_copy, command):
    (checkpoint_copy / "gap_pruned.json").write_text("[1]")
    docs = write_input(tmp_path, "docs.txt", CALIBRATION_TEXT)
    sizes = ["--samples", "2", "--seq-len", "16"]
    argv = {
        "prune": [
            "prune",
            "--model",
            checkpoint_copy,
            "--uniform",
            "0.3",
            "--criterion",
            "wanda",
            "--data",
            docs,
            *sizes,
            "--out",
            work_out(tmp_path, "p"),
        ],
        "table": ["table", "--model", checkpoint_copy, "--data", docs, *sizes, "--no-cache", "--out", work_out(tmp_path, "t.json")],
        "recover": [
            "recover",
            "--model",
            checkpoint_copy,
            "--method",
            "mezo",
            "--steps",
            "1",
            "--data",
            docs,
            "--seq-len",
            "16",
            "--out",
            work_out(tmp_path, "r"),
        ],
        "compare": ["compare", "--model", checkpoint_copy, "--data", docs, *sizes, "--out", work_out(tmp_path, "c.csv")],
    }[command]
    assert_refused(cli(argv), "does not hold a json object")


def test_a_folder_without_config_is_refused_by_the_preflight(tmp_path):
    import argparse

    from gap_engine.cli.preflight import preflight
    from gap_engine.core.errors import ModelLoadError

    (tmp_path / "notes.txt").write_text("not a model")
    args = argparse.Namespace(command="eval", model=str(tmp_path), data="wiki-sample")
    with pytest.raises(ModelLoadError, match="a folder without config.json"):
        preflight(args)


# ---- round 3: one long line of text is tokenized in bounded pieces --------------------------------
@pytest.mark.slow
def test_a_long_line_is_tokenized_in_bounded_pieces_with_the_same_ids(smol_tokenizer, monkeypatch):
    import numpy as np

    from gap_engine.data import tokens

    words = ("pruning", "structured", "layer", "budget", "attention", "channel", "width", "token", "window,", "loss.")
    line = " ".join(words[(i * 7) % len(words)] for i in range(60_000))  # ~400 kB, one line, one document
    whole = np.asarray(smol_tokenizer(line, add_special_tokens=False)["input_ids"], dtype=np.int64)
    limit = 16 * 1024
    monkeypatch.setattr(tokens, "TOKENIZE_PIECE_CHARS", limit)
    monkeypatch.setattr(tokens, "TOKENIZE_BATCH_CHARS", limit)
    calls: list[int] = []

    class Recording:
        eos_token_id = smol_tokenizer.eos_token_id

        def __call__(self, texts, **kwargs):
            calls.append(sum(map(len, texts)) if isinstance(texts, list) else len(texts))
            return smol_tokenizer(texts, **kwargs)

    stream = tokens.tokenize_stream(Recording(), ["a short document first", line])
    assert max(calls) <= limit, max(calls)  # no call holds the whole line (the bound on memory)
    assert len(calls) > len(line) // limit
    first = np.asarray(smol_tokenizer("a short document first", add_special_tokens=False)["input_ids"], dtype=np.int64)
    expected = np.concatenate([first, [smol_tokenizer.eos_token_id], whole])
    assert np.array_equal(stream, expected)  # byte-level BPE: cutting before a space changes no id


# ---- round 3: a cache that refuses new files ------------------------------------------------------
# sysfs refuses new files to every user, root included (chmod 555 would not stop root, which a CI
# runner may be): a real folder that cannot be written, as a read-only mount is.
UNWRITABLE_CACHE = "/sys"


@pytest.mark.parametrize("command", ["table", "prune-builtin", "recover", "eval-tasks"])
def test_a_cache_that_cannot_be_written_is_one_line_before_work(cli, tmp_path, monkeypatch, tiny_model_dir, tiny_checkpoint, command):
    docs = write_input(tmp_path, "docs.txt", CALIBRATION_TEXT)
    sizes = ["--samples", "2", "--seq-len", "16"]
    argv = {
        "table": ["table", "--model", tiny_model_dir, "--data", docs, *sizes, "--out", work_out(tmp_path, "t.json")],
        "prune-builtin": [
            "prune",
            "--model",
            "smollm2-135m",
            "--uniform",
            "0.1",
            "--criterion",
            "wanda",
            "--data",
            docs,
            *sizes,
            "--out",
            work_out(tmp_path, "p"),
        ],
        "recover": [
            "recover",
            "--model",
            tiny_checkpoint,
            "--method",
            "mezo",
            "--steps",
            "1",
            "--data",
            docs,
            "--seq-len",
            "16",
            "--out",
            work_out(tmp_path, "r"),
        ],
        # a model that is not built in: only the tasks' files and dense scores need the cache
        "eval-tasks": [
            "eval",
            "--model",
            tiny_checkpoint,
            "--tasks",
            "gap_wiki_next",
            "--limit",
            "2",
            "--data",
            docs,
            *sizes,
            "--no-throughput",
        ],
    }[command]
    monkeypatch.setenv("GAP_CACHE_DIR", UNWRITABLE_CACHE)
    assert_refused(cli(argv), f"the cache root {UNWRITABLE_CACHE} (GAP_CACHE_DIR) cannot be written")
    assert list((tmp_path / "work").iterdir()) == []


def test_commands_that_only_read_the_cache_work_on_one_that_cannot_be_written(cli, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", UNWRITABLE_CACHE)
    code, err, out = cli(["cache", "ls", "--json"])
    assert code == 0 and err == [], err
    assert json.loads(out) == []


# ---- round 3: a table for other weights is found from the checkpoint's record, before any load ----
@pytest.mark.parametrize("command", ["plan", "compare"])
def test_a_table_for_another_model_is_refused_before_the_model_loads(cli, tmp_path, monkeypatch, tiny_checkpoint, command):
    from gap_engine.model import loading

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(loading, "_load", no_load)
    table = write_input(tmp_path, "t.json", json.dumps(table_dict()))  # made for 'tiny-llama', fingerprint 0123456789abcdef
    docs = write_input(tmp_path, "docs.txt", CALIBRATION_TEXT)
    argv = {
        "plan": ["plan", "--table", table, "--budget", "0.2", "--model", tiny_checkpoint, "--out", work_out(tmp_path, "p.json")],
        "compare": [
            "compare",
            "--table",
            table,
            "--model",
            tiny_checkpoint,
            "--budgets",
            "0.2",
            "--eval-data",
            docs,
            "--out",
            work_out(tmp_path, "c.csv"),
        ],
    }[command]
    assert_refused(cli(argv), "loss table was built for 'tiny-llama' (fingerprint 0123456789abcdef), not for")


def test_a_table_for_a_model_of_other_depth_is_refused_before_the_model_loads(cli, tmp_path, monkeypatch, tiny_model_dir):
    from gap_engine.model import loading

    monkeypatch.setattr(loading, "_load", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    three = copy.deepcopy(table_dict())
    three["num_layers"] = 3
    three["components"] = [[layer, kind] for layer in range(3) for kind in ("attn", "mlp")]
    for field in ("delta", "smoothed", "cell_objective", "removed", "measured"):
        three[field] = three[field] + three[field][:2]
    table = write_input(tmp_path, "t.json", json.dumps(three))
    argv = ["plan", "--table", table, "--budget", "0.2", "--model", tiny_model_dir, "--out", work_out(tmp_path, "p.json")]
    assert_refused(cli(argv), "loss table is for a model with 3 layers, but")


# ---- round 3: a text too short for one window, found with the tokenizer alone -----------------------
@pytest.mark.parametrize("command", ["table", "eval", "prune"])
def test_a_text_too_short_for_one_window_is_one_line_before_the_model_loads(
    cli, tmp_path, monkeypatch, tiny_model_dir, tiny_checkpoint, command
):
    from gap_engine.model import loading

    monkeypatch.setattr(loading, "_load", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    short = write_input(tmp_path, "short.txt", "Too short.\n")
    sizes = ["--samples", "2", "--seq-len", "16"]
    argv = {
        "table": ["table", "--model", tiny_model_dir, "--data", short, *sizes, "--no-cache", "--out", work_out(tmp_path, "t.json")],
        "eval": ["eval", "--model", tiny_checkpoint, "--data", short, *sizes, "--no-dense", "--no-throughput", "--generations", "0"],
        "prune": [
            "prune",
            "--model",
            tiny_model_dir,
            "--uniform",
            "0.2",
            "--criterion",
            "wanda",
            "--data",
            short,
            *sizes,
            "--out",
            work_out(tmp_path, "p"),
        ],
    }[command]
    if command == "eval":  # held-out text is read in its report part, and one line cannot be divided
        assert_refused(cli(argv), "short.txt' has no report text (it is too small to split)")
        return
    line = assert_refused(cli(argv), "short.txt (calibration) has ")
    assert line.endswith("but one window of seq_len=16 needs at least 16"), line
