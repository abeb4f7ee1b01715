"""``gap`` run in this process, its exit status and output read back: the runner the in-process
CLI tests share (their fixtures add what each needs: a cache of its own, log lines on stderr)."""

from __future__ import annotations

from gap_engine.cli import main


def run_gap(capsys, *argv) -> tuple[int, list[str], str]:
    """(exit status, the non-blank stderr lines, stdout) of ``gap argv``."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out
