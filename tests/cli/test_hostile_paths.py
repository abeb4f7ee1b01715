"""Paths and names against the command line: no code from a model folder,
no output over an input (the cache's files included), no internal error from a path, nothing
named in a file reaching the network or written into a foreign folder, terminal-safe output.

Every refusal is checked the way docs/errors-and-limits.md states it: exit status 2, one
``gap: error:`` line, and every input byte-identical afterwards. Tiny random 2-layer Llama
folders with the real SmolLM2 tokenizer; the few subprocesses are the cases an in-process run
cannot show (a prompt on a terminal's stdin, stderr on a full device, a deleted working folder).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from inprocess_cli import run_gap

ROOT = Path(__file__).resolve().parents[2]


class _LiveStderr(logging.Handler):
    """Log records to whatever sys.stderr is now (capsys's), so log lines count as stderr lines."""

    def emit(self, record):
        sys.stderr.write(self.format(record) + "\n")


@pytest.fixture
def gap(capsys, tmp_path, monkeypatch):
    """Run ``gap`` in-process with a cache of its own: (exit status, stderr lines, stdout)."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    handler = _LiveStderr(logging.INFO)
    logging.getLogger().addHandler(handler)

    def run(*argv) -> tuple[int, list[str], str]:
        return run_gap(capsys, *argv)

    yield run
    logging.getLogger().removeHandler(handler)


def refused(result, message: str) -> str:
    code, err, _ = result
    assert code == 2 and len(err) == 1 and err[0].startswith("gap"), (code, err)
    assert "error:" in err[0] and message.lower() in err[0].lower(), err[0]
    return err[0]


def digests(*paths: Path) -> dict[str, str]:
    """sha256 of every file under ``paths`` (a file or a folder), by path."""
    out = {}
    for path in paths:
        for item in [path] if path.is_file() else sorted(path.rglob("*")):
            if item.is_file() and not item.is_symlink():
                out[str(item)] = hashlib.sha256(item.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol_tokenizer):
    """(plain model folder, gap checkpoint folder) of one tiny random Llama."""
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.rateplan import uniform_plan
    from gap_engine.pipeline.stages import prune_with_plan

    base = tmp_path_factory.mktemp("tiny")
    lm = tiny_lm("llama", smol_tokenizer)
    lm.model.save_pretrained(base / "tiny-llama")
    smol_tokenizer.save_pretrained(base / "tiny-llama")
    plan = uniform_plan(lm, 0.5, "magnitude")
    save_pruned(lm, plan, prune_with_plan(lm, plan, WindowSpec(n_samples=2, seq_len=16)).kept_indices(), base / "tiny-ck")
    return base / "tiny-llama", base / "tiny-ck"


@pytest.fixture(scope="module")
def tiny_table(tiny, smol_tokenizer):
    """A synthetic loss table of the tiny model (its real removed counts, made-up losses), beside it."""
    from conftest import tiny_lm
    from synthetic_tables import synthetic_table

    path = tiny[0].parent / "t.json"
    path.write_text(synthetic_table(tiny_lm("llama", smol_tokenizer), model=str(tiny[0])).to_json())
    return path


# ---- item 1: a model folder's code never runs ---------------------------------------------------------
def planted(folder: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``folder`` whose config.json names its own modeling file (which writes a marker when imported)."""
    import shutil

    evil, marker = tmp_path / "evil-model", tmp_path / "MARKER"
    shutil.copytree(folder, evil)
    (evil / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    config = json.loads((evil / "config.json").read_text())
    config["model_type"] = "evil"
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (evil / "config.json").write_text(json.dumps(config))
    return evil, marker


@pytest.mark.slow
def test_a_folder_naming_its_own_code_is_refused_with_no_prompt_on_a_waiting_terminal(tiny, tmp_path):
    """stdin an open pipe that never answers (a terminal nobody types in): no prompt, no wait, no code."""
    evil, marker = planted(tiny[0], tmp_path)
    argv = ["eval", "--model", evil, "--samples", "2", "--seq-len", "16", "--no-dense", "--no-throughput"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "GAP_CACHE_DIR": str(tmp_path / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "gap_engine", *map(str, argv)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    out, err = process.communicate(timeout=120)  # the pipe stays open until the process ends
    lines = err.decode().strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1, lines
    assert "names code of its own in auto_map" in lines[0] and "[y/N]" not in out.decode() + err.decode()
    assert not marker.exists()


@pytest.mark.parametrize("command", ["eval", "table", "export"])
def test_eval_table_and_export_refuse_a_folder_naming_its_own_code(command, gap, tiny, tmp_path):
    evil, marker = planted(tiny[0], tmp_path)
    before = digests(evil)
    argv = {
        "eval": ["eval", "--model", evil, "--samples", "2", "--seq-len", "16", "--no-dense"],
        "table": ["table", "--model", evil, "--samples", "2", "--seq-len", "16", "--out", tmp_path / "t.json"],
        "export": ["export", evil, "--out", tmp_path / "m.gguf"],
    }[command]
    refused(gap(*argv), "config.json names code of its own in auto_map (modeling_evil.EvilConfig")
    assert not marker.exists() and digests(evil) == before


# ---- item 2: no output over an input -------------------------------------------------------------------
def test_report_refuses_to_write_over_the_run_history_and_its_recovered_eval(gap, tiny_table, tmp_path):
    history = tmp_path / "cache" / "runs" / "history.sqlite"
    history.parent.mkdir(parents=True)
    history.write_bytes(b"SQLite format 3\x00 a history")
    recovered = tmp_path / "r.json"
    recovered.write_text('{"task_accuracy": {}}')
    before = digests(history, recovered)
    refused(gap("report", "--table", tiny_table, "--budget", "0.2", "--out", history), f"lies inside the cache {tmp_path / 'cache'}")
    refused(gap("report", "--table", tiny_table, "--run", "1", "--out", history), "lies inside the cache")
    refused(gap("report", "--table", tiny_table, "--recovered-eval", recovered, "--out", recovered), "is the same path as --recovered-eval")
    refused(gap("front", "--table", tiny_table, "--out", tmp_path / "cache"), "is the same path as the cache")
    assert digests(history, recovered) == before


def test_recover_refuses_to_write_over_its_teacher(gap, tiny, tmp_path):
    import shutil

    teacher = Path(shutil.copytree(tiny[1], tmp_path / "DP"))
    before = digests(teacher)
    argv = ["recover", "--model", tiny[1], "--method", "mezo", "--steps", "1", "--teacher", teacher]
    refused(gap(*argv, "--out", teacher), "is the same path as --teacher")
    refused(gap(*argv, "--out", teacher / "inside"), "lies inside --teacher")
    assert digests(teacher) == before and not (tmp_path / "DP.partial").exists()


# ---- item 3: paths that no file system call takes --------------------------------------------------------
PATHS = {
    "--out ~nosuchuser": (["front", "--table", "{t}", "--out", "~nosuchuser-gap/f.csv"], "no user named 'nosuchuser-gap'"),
    "--table ~nosuchuser": (["front", "--table", "~nosuchuser-gap/t.json", "--out", "{d}/f.csv"], "no user named"),
    "--data ~nosuchuser": (["table", "--model", "{m}", "--data", "~nosuchuser-gap/x.txt", "--out", "{d}/t.json"], "no user named"),
    "--model ~nosuchuser": (["eval", "--model", "~nosuchuser-gap/model"], "no user named"),
    "--out a symlink loop": (["front", "--table", "{t}", "--out", "{d}/loop"], "loop of symbolic links"),
    "--out under a symlink loop": (["front", "--table", "{t}", "--out", "{d}/loop/f.csv"], "loop of symbolic links"),
    "--out not UTF-8": (["front", "--table", "{t}", "--out", "{d}/bad" + os.fsdecode(b"\xff") + ".csv"], "not UTF-8"),
    "--out 256 bytes": (["front", "--table", "{t}", "--out", "{d}/" + "a" * 252 + ".csv"], "longer than the file system allows"),
}


@pytest.mark.parametrize("case", list(PATHS))
def test_paths_no_file_system_call_takes_are_one_line_refusals(case, gap, tiny, tiny_table, tmp_path):
    argv, message = PATHS[case]
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    fill = {"{t}": str(tiny_table), "{d}": str(tmp_path), "{m}": str(tiny[0])}
    refused(gap(*[_fill(a, fill) for a in argv]), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]  # no cache, no output, no temporary


def _fill(arg: str, fill: dict) -> str:
    for key, value in fill.items():
        arg = arg.replace(key, value)
    return arg


def test_the_crash_report_survives_an_argument_that_is_not_utf8(tmp_path, monkeypatch):
    from gap_engine.cli.main import write_crash_file

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    crash = write_crash_file(["front", "--out", "bad" + os.fsdecode(b"\xff")], RuntimeError("boom"))
    assert crash is not None and "--out bad\\udcff" in crash.read_text() and "RuntimeError: boom" in crash.read_text()


# ---- item 6: names from files stay local, nothing is written into a foreign folder --------------------
@pytest.mark.slow
def test_a_hub_dataset_named_in_a_table_never_reaches_the_network(gap, tiny, tiny_table, tmp_path, monkeypatch):
    import datasets

    def no_network(*args, **kwargs):
        raise AssertionError(f"load_dataset{args} was called")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    table = json.loads(tiny_table.read_text())
    table["spec"]["data"] = "nobody-gap/no-such-dataset:default:train"
    (tmp_path / "t.json").write_text(json.dumps(table))
    code, err, _ = gap(
        "plan", "--table", tmp_path / "t.json", "--model", tiny[0], "--allocator", "flap", "--budget", "0.2", "--out", tmp_path / "p.json"
    )
    assert code == 2 and "(named in a file) is not in the local datasets cache; names read from files never reach the network" in err[-1]
    assert not (tmp_path / "p.json").exists()


def test_a_work_folder_that_links_elsewhere_is_refused_and_left_alone(gap, tiny, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "r.partial").symlink_to(foreign)
    argv = ["recover", "--model", tiny[1], "--method", "mezo", "--steps", "1", "--out", tmp_path / "r"]
    refused(gap(*argv), "r.partial is a symbolic link")
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_a_cache_inside_the_model_folder_is_refused_before_it_is_created(gap, tiny, tmp_path, monkeypatch):
    import shutil

    model = Path(shutil.copytree(tiny[1], tmp_path / "ck"))
    before = digests(model)
    monkeypatch.setenv("GAP_CACHE_DIR", str(model / "cache"))
    refused(
        gap("eval", "--model", model, "--samples", "2", "--seq-len", "16"),
        f"the cache (GAP_CACHE_DIR) {model / 'cache'} lies inside --model",
    )
    refused(gap("table", "--model", model, "--out", tmp_path / "t.json"), "lies inside --model")
    assert digests(model) == before and not (model / "cache").exists()


@pytest.mark.slow
def test_prune_over_a_link_leaves_no_old_link_behind(gap, tiny, tmp_path):
    import shutil

    shutil.copytree(tiny[1], tmp_path / "previous")
    (tmp_path / "link").symlink_to(tmp_path / "previous")
    code, err, _ = gap("prune", "--model", tiny[0], "--uniform", "0.25", "--criterion", "magnitude", "--out", tmp_path / "link")
    assert code == 0, err
    assert {p.name for p in tmp_path.iterdir()} - {"cache"} == {"link", "previous"}  # no .link.old-<pid>
    assert (tmp_path / "link" / "gap_pruned.json").is_file() and not (tmp_path / "link").is_symlink()


# ---- item 7: what gap prints and writes ---------------------------------------------------------------
def test_cache_ls_shows_a_terminal_escape_read_from_disk_as_text(gap, tmp_path):
    # A spec whose text holds control characters is no table's (core.validate: the entry is not listed);
    # a folder name is what reaches the terminal, so the escape and the bell are in the key.
    key = "tiny-\x1b[2J-kl-split-fisher-\x07"
    entry = tmp_path / "cache" / "tables" / key
    entry.mkdir(parents=True)
    (entry / "table.json").write_text("{}")
    spec = {"data": "wiki-sample", "n_samples": 2, "seq_len": 16, "rate_grid": [0.0, 0.5]}
    meta = {"key": key, "format_version": 2, "table_sha256": "0" * 64, "model": "tiny", "spec": spec, "created": "2026-12-03"}
    (entry / "meta.json").write_text(json.dumps(meta))
    code, _, out = gap("cache", "ls")
    assert code == 0 and "tiny-\\x1b[2J-kl-split-fisher-\\x07" in out and "\x1b" not in out and "\x07" not in out


def test_a_legal_255_byte_output_name_is_written(gap, tiny_table, tmp_path):
    name = "a" * 251 + ".csv"
    code, err, _ = gap("front", "--table", tiny_table, "--out", tmp_path / name)
    assert code == 0, err
    assert {p.name for p in tmp_path.iterdir()} - {"cache"} == {name}  # no temporary left beside it


def test_temporaries_and_locks_of_a_255_byte_name_fit_name_max(tmp_path):
    from gap_engine.core.fsutil import NAME_MAX, atomic_directory, lock_path, temp_stem

    name = "é" * 127  # 254 bytes
    assert len(os.fsencode(temp_stem(name))) <= NAME_MAX - 32 and temp_stem("short") == "short"
    assert temp_stem(name) != temp_stem(name[:-1] + "e")  # the hash tells long names apart
    assert len(os.fsencode(lock_path(tmp_path / name).name)) <= NAME_MAX
    for _ in range(2):  # the second write replaces the first through the old-folder dance
        with atomic_directory(tmp_path / name) as folder:
            (folder / "x").write_text("x")
    assert [p.name for p in tmp_path.iterdir()] == [name]


@pytest.mark.slow
def test_stderr_on_a_full_device_still_exits_2(tmp_path):
    env = os.environ | {"PYTHONPATH": str(ROOT), "GAP_CACHE_DIR": str(tmp_path / "cache")}
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            # refused by the checks before torch loads: the process stays cheap
            [
                sys.executable,
                "-m",
                "gap_engine",
                "front",
                "--table",
                str(tmp_path / "t.json"),
                "--out",
                str(tmp_path / "f.csv"),
                "--n-buckets",
                "0",
            ],
            stderr=full,
            env=env,
            timeout=120,
        )
    assert result.returncode == 2


@pytest.mark.slow
def test_a_deleted_working_folder_is_one_line_before_torch_loads(tmp_path, tiny):
    gone = tmp_path / "gone"
    gone.mkdir()
    env = os.environ | {"PYTHONPATH": str(ROOT), "GAP_CACHE_DIR": str(tmp_path / "cache")}
    script = f'cd "{gone}" && rmdir "{gone}" && exec "{sys.executable}" -m gap_engine eval --model "{tiny[0]}"'
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "gap: error: the working folder is gone (No such file or directory): it was deleted or moved; "
        "cd into an existing folder and run gap again"
    ], result.stderr


@pytest.mark.slow
def test_a_million_identical_documents_are_read_as_one_document(tmp_path):
    from gap_engine.data.windows import read_corpus

    line = "Pruning keeps the attention heads that matter most to the loss."
    (tmp_path / "same.txt").write_text((line + "\n") * 1_000_000)
    corpus = read_corpus(str(tmp_path / "same.txt"))
    assert len(corpus.calibration) == len(corpus.heldout) == 1
    assert corpus.calibration[0] + " " + corpus.heldout[0] == line  # one copy, cut about 80/20 at a word
