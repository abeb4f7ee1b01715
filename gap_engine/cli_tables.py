"""`gap table` and `gap cache`: build loss tables and manage the table cache from a shell.

``register(subparsers)`` adds the subcommands to the `gap` argparse parser; every
subcommand sets ``func`` to a handler ``(args) -> int``. Handlers raise GapError
subclasses with a one-line message for bad input; `gap`'s main() prints it and exits 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .errors import GapError, TableError
from .fsutil import atomic_write_text

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    """Add `table` and `cache` to the `gap` subcommands."""
    from .importance import CRITERIA
    from .tables import DEFAULT_RATE_GRID, METHODS, MODES, OBJECTIVES, TableSpec

    defaults = TableSpec()
    table = subparsers.add_parser(
        "table",
        help="build (or read from the cache) a loss table",
        description="Measure how much the global objective grows when each layer's attention or MLP "
        "alone is pruned at each rate of a grid (GAP's loss table).",
    )
    table.add_argument("--model", default="smollm2-135m", help="built-in name, model folder, .gguf file or hub id")
    table.add_argument("--data", default=defaults.data, help="calibration text source (default: %(default)s)")
    table.add_argument("--samples", type=int, default=defaults.n_samples, help="calibration windows (default: %(default)s)")
    table.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per window (default: %(default)s)")
    table.add_argument("--seed", type=int, default=defaults.seed, help="which windows are drawn (default: %(default)s)")
    table.add_argument(
        "--rates",
        default=",".join(f"{r:g}" for r in DEFAULT_RATE_GRID),
        help="comma-separated rate grid starting at 0 (default: 0, 1/16, ..., 15/16)",
    )
    table.add_argument("--criterion", choices=CRITERIA, default=defaults.criterion, help="within-layer importance")
    table.add_argument("--objective", choices=OBJECTIVES, default=defaults.objective, help="nll or kl (default: nll)")
    table.add_argument("--mode", choices=MODES, default=defaults.mode, help="split: attention and MLP apart; block: together")
    table.add_argument(
        "--approx",
        choices=[m for m in METHODS if m != "exact"],
        default=None,
        help="estimate from one gradient pass instead of measuring every cell",
    )
    table.add_argument("--channel-multiple", type=int, default=defaults.channel_multiple, help="MLP width granularity")
    table.add_argument("--batch-size", type=int, default=defaults.batch_size, help="windows per forward pass")
    table.add_argument("--no-cache", action="store_true", help="neither read nor write the table cache")
    table.add_argument("--out", required=True, help="where to write the table (.json, or .csv for the long format)")
    table.set_defaults(func=run_table)

    cache = subparsers.add_parser("cache", help="list or remove cached loss tables")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="{ls,rm}")
    cache_sub.required = True
    ls = cache_sub.add_parser("ls", help="list cached loss tables")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a text table")
    ls.set_defaults(func=run_cache_ls)
    rm = cache_sub.add_parser("rm", help="remove one cached loss table")
    rm.add_argument("key", help="a key from `gap cache ls`")
    rm.set_defaults(func=run_cache_rm)


def spec_from_args(args: argparse.Namespace):
    """The TableSpec the `table` arguments describe (TableError on bad values)."""
    from .tables import TableSpec, parse_rate_grid

    spec = TableSpec(
        data=args.data,
        n_samples=args.samples,
        seq_len=args.seq_len,
        seed=args.seed,
        criterion=args.criterion,
        rate_grid=parse_rate_grid(args.rates),
        objective=args.objective,
        mode=args.mode,
        method=args.approx or "exact",
        channel_multiple=args.channel_multiple,
        batch_size=args.batch_size,
    )
    return spec.validate()


def _format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class StderrProgress:
    """`done/total, eta` on stderr: rewritten in place on a terminal, a line every few seconds otherwise."""

    def __init__(self, label: str, stream=None, every: float = 5.0):
        self.label = label
        self.stream = stream or sys.stderr
        self.every = every
        self._last = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int, eta: float | None) -> None:
        now = time.monotonic()
        final = done >= total
        if not self._tty and not final and now - self._last < self.every:
            return
        self._last = now
        text = f"{self.label}: {done}/{total} ({100 * done / max(total, 1):.0f}%), eta {_format_seconds(eta)}"
        if self._tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def run_table(args: argparse.Namespace) -> int:
    from .models import load_model
    from .tables import build_table

    spec = spec_from_args(args)
    out = Path(args.out)
    if out.suffix not in (".json", ".csv"):
        raise TableError(f"--out must end in .json or .csv, got '{out.name}'")
    if out.is_dir():
        raise TableError(f"--out {out} is a folder; give a file name")
    lm = load_model(args.model)
    unit = "cells" if spec.method == "exact" else "batches"
    table = build_table(lm, spec, progress=StderrProgress(f"table {unit}"), use_cache=not args.no_cache)
    atomic_write_text(out, table.to_csv() if out.suffix == ".csv" else table.to_json())
    print(
        f"wrote {out}: {len(table.components)} components x {len(table.rate_grid)} rates, "
        f"dense {spec.objective} {table.dense_objective:.4f}, key {table.key}"
    )
    return 0


def run_cache_ls(args: argparse.Namespace) -> int:
    from .cache import list_tables

    rows = list_tables()
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no cached loss tables")
        return 0
    print(f"{'key':<64} {'model':<16} {'data':<12} {'N x T':>9} {'rates':>5} {'size':>8}  created")
    for row in rows:
        spec = row["spec"]
        shape = f"{spec.get('n_samples')}x{spec.get('seq_len')}"
        print(
            f"{row['key']:<64} {str(row['model'])[:16]:<16} {str(spec.get('data'))[:12]:<12} {shape:>9} "
            f"{len(spec.get('rate_grid', [])):>5} {row['size'] / 1024:>6.1f}kB  {row['created']}"
        )
    return 0


def run_cache_rm(args: argparse.Namespace) -> int:
    from .cache import remove_table

    remove_table(args.key)
    print(f"removed {args.key}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (the `gap` CLI normally calls the handlers)."""
    parser = argparse.ArgumentParser(prog="gap")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except GapError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
