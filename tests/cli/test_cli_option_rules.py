"""Options against the command line: one rule per option, checked by every command;
cached teacher text checked against the request; paths recorded absolute; bounds and messages.

Every refusal is checked as docs/errors-and-limits.md states it: exit status 2, one ``gap:
error:`` line, nothing written. Tiny random two-layer Llama folders with the real SmolLM2
tokenizer (o_proj 64 inputs, down_proj 96: a refit needs 96 calibration tokens).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
from inprocess_cli import run_gap

from gap_engine.cli import main

ROOT = Path(__file__).resolve().parents[2]
TOO_FEW = ["--samples", "2", "--seq-len", "32"]  # 64 calibration tokens: fewer than down_proj's 96 inputs
ENOUGH = ["--samples", "4", "--seq-len", "32"]  # 128


class _LiveStderr(logging.Handler):
    """Log records to whatever sys.stderr is now (capsys's), so log lines count as stderr lines."""

    def emit(self, record):
        sys.stderr.write(self.format(record) + "\n")


@pytest.fixture
def gap(capsys, tmp_path, monkeypatch):
    """Run ``gap`` in-process with a cache of its own: (exit status, stderr lines, stdout)."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GAP_FORCE_SIZE", raising=False)
    handler = _LiveStderr(logging.INFO)
    logging.getLogger().addHandler(handler)

    def run(*argv) -> tuple[int, list[str], str]:
        return run_gap(capsys, *argv)

    yield run
    logging.getLogger().removeHandler(handler)


def refused(result, message: str) -> str:
    """Exit 2 and a last stderr line ``gap: error: ...`` naming ``message``; returns that line."""
    code, err, _ = result
    assert code == 2 and err and err[-1].startswith("gap: error: "), (code, err)
    assert message.lower() in err[-1].lower(), err[-1]
    return err[-1]


def one_line(result, message: str) -> str:
    """``refused``, with that line the only one: refused before any work."""
    line = refused(result, message)
    assert len(result[1]) == 1, result[1]
    return line


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol_tokenizer):
    """A tiny random Llama folder (absolute path) and a loss table of it (fisher, 4 x 32 tokens)."""
    from conftest import tiny_lm

    base = tmp_path_factory.mktemp("issue44")
    lm = tiny_lm("llama", smol_tokenizer)
    folder = base / "tiny"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    table = base / "t.json"
    argv = ["table", "--model", str(folder), "--estimator", "fisher", "--rates", "0,0.5", *ENOUGH, "--out", str(table)]
    assert main(argv) == 0
    return folder, table


# ---- item 4: one check per rule --------------------------------------------------------------------
@pytest.mark.parametrize("command", ["table", "prune", "compare"])
@pytest.mark.slow
def test_a_refit_from_too_few_tokens_is_refused_by_every_command_alike(gap, tiny, tmp_path, command):
    folder, _ = tiny
    spec = ["--estimator", "exact", "--compensate", "refit", "--rates", "0,0.5", *TOO_FEW]
    argv = {
        "table": ["table", "--model", folder, *spec, "--out", tmp_path / "t.json"],
        "prune": ["prune", "--model", folder, "--budget", "0.2", *spec, "--out", tmp_path / "pruned"],
        "compare": ["compare", "--model", folder, "--budgets", "0.2", *spec, "--out", tmp_path / "c.csv"],
    }[command]
    line = refused(gap(*argv), "give at least 96")
    assert "from 64 calibration tokens" in line and "down_proj (96 inputs)" in line
    assert not any(tmp_path.glob("t.json")) and not any(tmp_path.glob("pruned")) and not any(tmp_path.glob("c.csv"))


@pytest.mark.slow
def test_a_refit_table_from_enough_tokens_is_built(gap, tiny, tmp_path):
    folder, _ = tiny
    out = tmp_path / "t.json"
    argv = ["table", "--model", folder, "--estimator", "exact", "--compensate", "refit", "--rates", "0,0.5", *ENOUGH, "--out", out]
    code, err, _ = gap(*argv)
    assert code == 0, err
    assert json.loads(out.read_text())["spec"]["compensation"] == "refit"


def test_explicit_options_tell_a_given_default_from_a_default():
    from gap_engine.cli.parser import explicit_options

    given = explicit_options(["compare", "--model", "m", "--table", "t.json", "--samples", "64", "--out", "o"])
    assert {"model", "table", "samples", "out"} <= given
    assert not given & {"seq_len", "data", "criterion", "batch_size", "evo_generations"}
    assert "estimator" in explicit_options(["table", "--approx", "fisher"])  # a deprecated alias is given too
    locked = ["plan", "--table", "t.json", "--budget", "0.2", "--out", "p.json"]
    assert "lock" in explicit_options([*locked, "--lock", "0", "--lock", "1:0.5"])  # an option that appends
    assert "lock" not in explicit_options(locked)


MOOT = {
    "compare --table --samples": (["compare", "--table", "{table}", "--samples", "2"], "--samples cannot apply with --table"),
    "compare --table --samples 64 (its default)": (["compare", "--table", "{table}", "--samples", "64"], "--samples cannot apply"),
    "compare --table --samples --seq-len": (
        ["compare", "--table", "{table}", "--samples", "2", "--seq-len", "32", "--compensate", "refit"],
        "--samples and --seq-len cannot apply with --table",
    ),
    "compare --table --data": (["compare", "--table", "{table}", "--data", "news-sample"], "--data cannot apply"),
    "compare --table --criterion": (["compare", "--table", "{table}", "--criterion", "wanda"], "--criterion cannot apply"),
    "compare --table --rates --estimator": (
        ["compare", "--table", "{table}", "--rates", "0,0.5", "--estimator", "exact"],
        "--rates and --estimator cannot apply",
    ),
    "compare --evo-offspring without evo": (["compare", "--table", "{table}", "--evo-offspring", "8"], "without the evo allocator"),
    "compare --limit without --tasks": (["compare", "--table", "{table}", "--limit", "5"], "--limit cannot apply without --tasks"),
    "prune --uniform --rates": (["prune", "--uniform", "0.2", "--rates", "0,0.5"], "--rates cannot apply without --budget"),
    "prune --uniform --rounds": (["prune", "--uniform", "0.2", "--rounds", "2"], "--rounds cannot apply without --budget"),
    "prune --uniform --obs-samples": (["prune", "--uniform", "0.2", "--obs-samples", "8"], "--obs-samples cannot apply unless"),
    "prune --plan --channel-multiple": (["prune", "--plan", "{plan}", "--channel-multiple", "16"], "with --plan"),
    "plan --evo-generations with dp": (["plan", "--table", "{table}", "--budget", "0.2", "--evo-generations", "2"], "evo allocator"),
    "eval --num-fewshot without --tasks": (["eval", "--num-fewshot", "2"], "--num-fewshot cannot apply without --tasks"),
    "table --ray-workers without --ray": (["table", "--ray-workers", "3"], "--ray-workers cannot apply without --ray"),
    "table --profile without --dry-run": (["table", "--profile", "h100"], "--profile cannot apply without --dry-run"),
    "recover --force-size without teacher text": (
        ["recover", "--method", "lora", "--steps", "1", "--data", "news-sample", "--force-size"],
        "--force-size cannot apply without teacher text",
    ),
}


@pytest.mark.parametrize("name", list(MOOT))
def test_an_option_that_cannot_apply_is_refused_not_ignored(gap, tiny, tmp_path, name):
    folder, table = tiny
    argv, message = MOOT[name]
    plan = tmp_path / "p.json"
    plan.write_text("{}")  # never read: the option is refused first
    out = tmp_path / "out"
    argv = [a.replace("{table}", str(table)).replace("{plan}", str(plan)) for a in argv]
    if argv[0] != "plan":
        argv += ["--model", str(folder)]
    line = one_line(gap(*argv, *(["--out", out] if argv[0] != "eval" else [])), message)
    assert line.startswith(f"gap: error: gap {argv[0]}: ")
    assert not out.exists()


@pytest.mark.slow
def test_compare_with_a_table_takes_the_options_that_apply(gap, tiny, tmp_path):
    folder, table = tiny
    out = tmp_path / "c.csv"
    argv = ["compare", "--model", folder, "--table", table, "--budgets", "0.2", "--allocators", "dp", "--seed", "3"]
    code, err, _ = gap(*argv, "--compensate", "bias", "--eval-samples", "2", "--eval-seq-len", "16", "--out", out)
    assert code == 0, err
    assert out.is_file()


# ---- item 6: paths recorded absolute -------------------------------------------------------------
RECOVER = ["--method", "lora", "--steps", "1", "--seq-len", "16", "--pool-windows", "2", "--no-history", "--no-eval-before"]
RECOVER += ["--eval-samples", "1", "--eval-seq-len", "16", "--generations", "0", "--data", "news-sample"]


def _relative_records(gap, tiny, tmp_path, monkeypatch) -> Path:
    """A checkpoint, a table and a plan made with ``--model m`` from the folder holding ``m``; returns that folder."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(tiny[0], work / "m")
    monkeypatch.chdir(work)
    for argv in (
        ["prune", "--model", "m", "--uniform", "0.25", "--criterion", "magnitude", "--compensate", "none", "--out", "ck"],
        ["table", "--model", "m", "--estimator", "fisher", "--rates", "0,0.5", *ENOUGH, "--out", "t.json"],
        ["plan", "--table", "t.json", "--budget", "0.2", "--out", "p.json"],
    ):
        code, err, _ = gap(*argv)
        assert code == 0, err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return work


def _uses_the_recorded_model_from_elsewhere(gap, work: Path) -> None:
    """From another working folder: recover distils from the checkpoint's base model, and the
    allocators that load the table's model find it."""
    code, err, out = gap("recover", "--model", work / "ck", *RECOVER, "--out", "r")
    assert code == 0, err
    assert "objective: kd (the default: the dense base model is reachable)" in out, out
    for allocator in ("flap", "slimgpt"):
        code, err, _ = gap("plan", "--table", work / "t.json", "--budget", "0.2", "--allocator", allocator, "--out", f"{allocator}.json")
        assert code == 0, err


@pytest.mark.slow
def test_a_relative_model_folder_is_recorded_by_its_absolute_path(gap, tiny, tmp_path, monkeypatch):
    work = _relative_records(gap, tiny, tmp_path, monkeypatch)
    model = str(work / "m")
    assert json.loads((work / "ck" / "gap_pruned.json").read_text())["base_model"] == model
    assert json.loads((work / "t.json").read_text())["model"] == model
    assert json.loads((work / "p.json").read_text())["model"] == model
    _uses_the_recorded_model_from_elsewhere(gap, work)
    # One folder named two ways is one cache entry: the absolute name gets the key the relative one built under.
    code, err, _ = gap("table", "--model", work / "m", "--estimator", "fisher", "--rates", "0,0.5", *ENOUGH, "--out", "again.json")
    assert code == 0, err
    assert json.loads(Path("again.json").read_text())["key"] == json.loads((work / "t.json").read_text())["key"]


@pytest.mark.slow
def test_an_older_record_with_a_relative_path_is_read_against_its_own_folder(gap, tiny, tmp_path, monkeypatch):
    work = _relative_records(gap, tiny, tmp_path, monkeypatch)
    for path, field in ((work / "ck" / "gap_pruned.json", "base_model"), (work / "t.json", "model")):
        data = json.loads(path.read_text())
        data[field] = "m"  # as gap wrote it before paths were recorded absolute
        path.write_text(json.dumps(data))
    _uses_the_recorded_model_from_elsewhere(gap, work)


# ---- item 7b: an error after a progress line ------------------------------------------------------
def test_a_line_written_after_an_open_progress_line_starts_a_line_of_its_own():
    import io

    from gap_engine.cli.output import TerminalSafe

    buffer = io.StringIO()
    stream = TerminalSafe(buffer, progress=True)
    stream.write("\rrecover: teacher text: writing 0 of 64 tokens, eta 1s   ")
    stream.write("\rrecover: teacher text: writing 0 of 64 tokens, eta 0s   ")  # rewritten in place
    print("gap: error: cannot write tokens.npy", file=stream)
    assert buffer.getvalue().split("\n")[-2] == "gap: error: cannot write tokens.npy"
    assert buffer.getvalue().count("\n") == 2  # the progress line ended once, the error line once
    stream.write("\rtable cells: 4/4 (100%), eta 0s\n")  # a progress line that ends itself
    print("wrote t.json", "(4 cells)", file=stream)  # pieces of one print stay on one line
    assert buffer.getvalue().split("\n")[-2] == "wrote t.json (4 cells)"


# ---- item 7a: teacher text a person can wait for ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tiny, tmp_path_factory):
    folder, _ = tiny
    out = tmp_path_factory.mktemp("issue44-ck") / "ck"
    argv = ["prune", "--model", str(folder), "--uniform", "0.25", "--criterion", "magnitude", "--compensate", "none", "--out", str(out)]
    assert main(argv) == 0
    return out


@pytest.mark.slow
def test_recover_refuses_teacher_text_past_the_time_bound_and_force_size_lifts_it(gap, tiny_checkpoint, tmp_path, monkeypatch):
    from gap_engine.core.limits import SizeLimits
    from gap_engine.pipeline import recovery

    monkeypatch.setattr(recovery, "LIMITS", SizeLimits(teacher_seconds=0))  # any text this machine must write is too long
    argv = ["recover", "--model", tiny_checkpoint, *RECOVER[:-2], "--data", "teacher:64"]
    line = refused(gap(*argv, "--out", tmp_path / "r"), "teacher:64 would take about ")
    assert "predicted by the cost model" in line and "pass --force-size" in line
    assert not (tmp_path / "r").exists() and not (tmp_path / "r.partial").exists()
    code, err, out = gap(*argv, "--force-size", "--out", tmp_path / "r")
    assert code == 0, err
    assert "teacher:64" in out


# ---- item 7c: a full disk during a GGUF export ------------------------------------------------------
def test_a_write_cut_short_without_an_errno_says_the_disk_is_full(tmp_path):
    from gap_engine.core.errors import OutputError
    from gap_engine.core.fsutil import atomic_file

    target = tmp_path / "m.gguf"
    with pytest.raises(OutputError) as info, atomic_file(target) as tmp:
        tmp.write_bytes(b"x" * 687632)
        raise OSError("3145728 requested and 687632 written")  # numpy's tofile on a short write
    assert str(info.value) == f"cannot write {target}: No space left on device"
    assert list(tmp_path.iterdir()) == []  # no output, no temporary


@pytest.mark.slow
def test_a_gguf_export_that_fills_the_disk_in_its_tensors_is_one_line_naming_the_file(gap, tiny_checkpoint, tmp_path):
    import resource

    from gguf import GGUFReader

    probe = tmp_path / "probe.gguf"
    assert gap("export", tiny_checkpoint, "--out", probe)[0] == 0
    largest = max(GGUFReader(str(probe), "r").tensors, key=lambda t: int(t.n_bytes))
    limit = int(largest.data_offset) + int(largest.n_bytes) // 2  # half way through a tensor numpy's tofile writes
    probe.unlink()
    work = tmp_path / "work"
    work.mkdir()
    out = work / "m.gguf"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ: writes past it fail
    try:
        result = gap("export", tiny_checkpoint, "--out", out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    line = refused(result, f"cannot write {out}: File too large")
    assert "requested and" not in line
    assert list(work.iterdir()) == []


# ---- item 7d: gap's own GGUF given to a command that loads through transformers -----------------------
@pytest.mark.slow
def test_a_gguf_gap_exported_is_one_line_saying_it_runs_in_llama_cpp(gap, tiny_checkpoint, tmp_path):
    out = tmp_path / "m.gguf"
    code, err, _ = gap("export", tiny_checkpoint, "--out", out)
    assert code == 0, err
    line = one_line(
        gap("eval", "--model", out, "--samples", "2", "--seq-len", "16", "--no-dense"), "is a pruned model that gap export wrote"
    )
    assert "for llama.cpp" in line and f"llama-cli -m {out}" in line and "docs/deploying.md" in line
    assert "Unrecognized model identifier" not in line
