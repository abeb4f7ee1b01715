"""Every file in bench/results/ is regenerated, whole, by the command written at its top.

A markdown result starts with ``<!-- gap-bench: {"script": ..., "argv": [...], "files": [...]} -->``
(``bench/report.py``); every other file there (a CSV or JSON lines of rows) is one of the ``files``
of a markdown result's header. For each result this runs the recorded script's own argument
parser (``build_parser()``, the script imported without running it) on the recorded arguments, so
a result whose command the script no longer accepts fails here, and checks that the text states
the same command for a reader.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"


def _report():
    """bench/report.py, imported the way the benchmarks import it (bench/ on the path)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import report

    return report


def load_script(script: str):
    """The benchmark ``script`` (relative to the repository root) as a module, without running its main()."""
    _report()
    path = ROOT / script
    if path.parent != BENCH or path.suffix != ".py" or not path.is_file():
        raise AssertionError(f"{script} is not a Python benchmark in bench/")
    name = f"_bench_result_check_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses in the script look their module up here
    spec.loader.exec_module(module)
    return module


def parse_recorded(script: str, argv: list[str]) -> argparse.Namespace:
    """The script's parser on ``argv``; AssertionError (with argparse's message) when it refuses them."""
    module = load_script(script)
    build = getattr(module, "build_parser", None)
    if build is None:
        raise AssertionError(f"{script} exposes no build_parser()")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{script} no longer accepts {argv}: {err.getvalue().strip().splitlines()[-1]}") from None


def stated_commands(text: str, script: str) -> list[list[str]]:
    """Every command line in ``text`` that runs ``script``, as its argument list (after the script)."""
    out = []
    for line in text.splitlines():
        if script not in line:
            continue
        rest = line.split(script, 1)[1].split("`", 1)[0]
        try:
            out.append(shlex.split(rest, comments=True))
        except ValueError:
            continue  # a sentence that names the script, not a command line
    return out


def check_result(path: Path, claimed: dict[str, Path]) -> None:
    """One file of bench/results/: a markdown result with a valid command, or a file one claims."""
    if path.suffix != ".md":
        if path.name not in claimed:
            raise AssertionError(f"{path.name}: no markdown result's header lists it among the files its command writes")
        return
    record = _report().read_header(path)
    if record is None:
        raise AssertionError(f"{path.name}: no gap-bench header on its first line")
    parse_recorded(record["script"], record["argv"])
    body = path.read_text(encoding="utf-8").split("\n", 1)[1]
    if record["argv"] not in stated_commands(body, record["script"]):
        raise AssertionError(f"{path.name}: its text does not state the command of its header")
    for name in record.get("files", []):
        if not (path.parent / name).is_file():
            raise AssertionError(f"{path.name}: its header lists {name}, which is not there")


def claimed_files() -> dict[str, Path]:
    """name -> the markdown result whose header lists it among its command's files."""
    claimed = {}
    for md in sorted(RESULTS.glob("*.md")):
        record = _report().read_header(md)
        for name in (record or {}).get("files", []):
            claimed[name] = md
    return claimed


@pytest.mark.parametrize("name", sorted(path.name for path in RESULTS.iterdir()))
def test_every_result_file_is_written_by_the_command_at_its_top(name):
    check_result(RESULTS / name, claimed_files())


def test_a_result_whose_command_the_script_refuses_fails(tmp_path):
    report = _report()
    good = tmp_path / "good.md"
    good.write_text(report.with_header("# t\n\n`python bench/bench_planner.py --repeats 3`", "bench/bench_planner.py", ["--repeats", "3"]))
    check_result(good, {})
    stale = tmp_path / "stale.md"
    stale.write_text(
        report.with_header("`python bench/bench_planner.py --no-such-option 1`", "bench/bench_planner.py", ["--no-such-option", "1"])
    )
    with pytest.raises(AssertionError, match="no longer accepts"):
        check_result(stale, {})
    unstated = tmp_path / "unstated.md"
    unstated.write_text(report.with_header("`python bench/bench_planner.py --repeats 5`", "bench/bench_planner.py", ["--repeats", "3"]))
    with pytest.raises(AssertionError, match="does not state the command"):
        check_result(unstated, {})
    bare = tmp_path / "bare.md"
    bare.write_text("# no header\n")
    with pytest.raises(AssertionError, match="no gap-bench header"):
        check_result(bare, {})
    rows = tmp_path / "rows.csv"
    rows.write_text("a,b\n")
    with pytest.raises(AssertionError, match="no markdown result's header lists it"):
        check_result(rows, {})
    check_result(rows, {"rows.csv": good})


def test_the_header_round_trips_arguments_an_html_comment_cannot_hold(tmp_path):
    report = _report()
    argv = ["--name", "x--y", "--> end", "", "ünï"]
    path = tmp_path / "r.md"
    path.write_text(report.with_header("body", "bench/bench_planner.py", argv, files=["r.csv"]))
    first = path.read_text().splitlines()[0]
    assert first.startswith("<!-- gap-bench: ") and first.endswith(" -->") and "--" not in first[5:-3]
    assert report.read_header(path) == {"script": "bench/bench_planner.py", "argv": argv, "files": ["r.csv"]}


def test_the_machine_line_reads_the_machine(monkeypatch):
    import time

    import torch

    report = _report()
    line = report.machine_line((1.0, 2.0, 3.0), time.perf_counter())
    assert f"{report.usable_cores()} CPU cores" in line and f"{torch.get_num_threads()} torch threads" in line
    assert f"accelerator {report.accelerator()}" in line and f"torch {torch.__version__}" in line
    assert "at the start 1.0 / 2.0 / 3.0, at the end " in line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert report.accelerator() == "none" and "accelerator none" in report.machine_description()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100")
    assert "accelerator 2 x NVIDIA H100" in report.machine_description()
