"""How much of the engine is the method: code lines of the method's files against the engine's and the repository's.

    python bench/code_share.py [--rev REV ...]

The method is what the paper describes, read top to bottom: the front door (``api.py``), the loss table's cells
(estimated and measured), the dynamic program and the front it gives, the surgery that slices heads and channels, the
compensation of the cut and the units both count in. Everything else in ``gap_engine/`` is support: caching,
validation, progress, the cost model, export, recovery, views. A code line is a line holding Python code: blank lines,
comments and docstrings are not counted. With ``--rev``, each git revision named is counted as well (its files read
with ``git show``, nothing checked out), so a redesign prints its before and after from one command.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A file missing at a revision counts 0; one the method gains must be added here to count.
METHOD = {
    "front door": ("gap_engine/api.py",),
    "loss table": (
        "gap_engine/tables/cells.py",
        "gap_engine/tables/estimate.py",
        "gap_engine/tables/exact.py",
        "gap_engine/tables/exact_fill.py",
    ),
    "dynamic program": ("gap_engine/core/knapsack.py", "gap_engine/plan/problem.py", "gap_engine/plan/front.py"),
    "surgery": ("gap_engine/prune/surgery.py", "gap_engine/model/slicing.py"),
    "compensation": ("gap_engine/prune/compensate.py", "gap_engine/prune/compensation_pass.py"),
    "units": ("gap_engine/model/units.py",),
}
SKIP_TOP = (".venv", ".git", "cache", "runs", "node_modules")


def code_lines(source: str) -> int:
    """Lines of ``source`` that hold code (no blank, comment-only or docstring line)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return 0
    docstring_lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            if isinstance(body[0].value.value, str):
                docstring_lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(line for line in range(token.start[0], token.end[0] + 1) if line not in docstring_lines)
    return len(lines)


def files_at(rev: str | None) -> list[str]:
    """The repository's tracked Python files at ``rev`` (the working tree's tracked and new files when None)."""
    if rev is None:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    else:
        listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev], cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in listed.stdout.split() if f.endswith(".py") and not f.startswith(SKIP_TOP)]


def read(path: str, rev: str | None) -> str:
    if rev is None:
        file = ROOT / path
        return file.read_text(encoding="utf-8") if file.is_file() else ""
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else ""


def share(rev: str | None) -> dict[str, int]:
    """Code lines of each part of the method, the method, the engine and the repository at ``rev``."""
    counts = {path: code_lines(read(path, rev)) for path in files_at(rev)}
    parts = {part: sum(counts.get(path, 0) for path in paths) for part, paths in METHOD.items()}
    engine = sum(n for path, n in counts.items() if path.startswith("gap_engine/"))
    return parts | {"method": sum(parts.values()), "engine": engine, "repository": sum(counts.values())}


def table(columns: Iterable[tuple[str, dict[str, int]]]) -> list[str]:
    columns = list(columns)
    lines = ["| code lines | " + " | ".join(name for name, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for row in [*METHOD, "method", "engine", "repository"]:
        lines.append(f"| {row} | " + " | ".join(f"{c[row]:,}" for _, c in columns) + " |")
    lines.append("| method / engine | " + " | ".join(f"1 in {c['engine'] / c['method']:.1f}" for _, c in columns) + " |")
    lines.append("| method / repository | " + " | ".join(f"1 in {c['repository'] / c['method']:.1f}" for _, c in columns) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rev", action="append", default=[], help="a git revision to count too (repeatable), e.g. a commit before a redesign"
    )
    args = parser.parse_args(argv)
    columns = [(rev, share(rev)) for rev in args.rev] + [("working tree", share(None))]
    print("\n".join(table(columns)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
