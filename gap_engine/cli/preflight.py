"""Checks every ``gap`` command passes before its handler (and torch) is imported.

Sizes first: each resource-sized option has a floor (what makes sense) and a ceiling (what
the machine can hold, ``limits.LIMITS``); a value past a ceiling is refused with one line
naming the limit and the way past it (``--force-size`` or ``GAP_FORCE_SIZE=1``). Then the
output: ``--out`` must be writable, of the right kind (a folder for ``prune``, a file for
the others), and ``prune`` replaces only an empty folder or an earlier checkpoint. So a
bad value costs a fraction of a second, not a model load and a half-finished measurement.
"""

from __future__ import annotations

import argparse

from gap_engine.core.errors import DataError, OutputError
from gap_engine.core.fsutil import cache_root, check_output
from gap_engine.core.limits import LIMITS, check_at_most, check_windows

# option dest -> (flag, floor, ceiling field of LIMITS or None, what one unit is)
SIZE_OPTIONS: dict[str, tuple[str, int, str | None, str]] = {
    "samples": ("--samples", 1, "samples", "windows"),
    "seq_len": ("--seq-len", 2, "seq_len", "tokens per window"),
    "batch_size": ("--batch-size", 1, "batch_size", "windows per forward pass"),
    "eval_samples": ("--eval-samples", 1, "samples", "windows"),
    "eval_seq_len": ("--eval-seq-len", 2, "seq_len", "tokens per window"),
    "n_buckets": ("--n-buckets", 1, "n_buckets", "budget buckets"),
    "generations": ("--generations", 0, "generations", "generations"),
    "evo_generations": ("--evo-generations", 0, "evo_generations", "rounds"),
    "evo_offspring": ("--evo-offspring", 1, "evo_offspring", "candidates per round"),
    "channel_multiple": ("--channel-multiple", 1, "channel_multiple", "channels"),
    "rounds": ("--rounds", 1, "rounds", "rounds, each a loss table of the whole model"),
    "ray_workers": ("--ray-workers", 1, "ray_workers", "worker processes, each holding the model"),
    "seed": ("--seed", 0, "seed", ""),
    "keep_params": ("--keep-params", 1, None, "parameters"),
}
# Commands whose --out is a folder (and `export --format hf`); every other --out is a file.
FOLDER_OUTPUTS = ("prune",)
# Commands that always use the on-disk cache (tables, converted models, the run history).
CACHE_COMMANDS = ("table", "compare", "models", "cache")
# The built-in model names (models.BUILTIN_MODELS; not imported: it needs torch). Loading one uses the cache.
BUILTIN_NAMES = ("smollm2-135m", "gemma3-270m")
# The file a gap checkpoint folder holds (checkpoint.PRUNED_MARKER; not imported: it needs torch).
CHECKPOINT_MARKER = "gap_pruned.json"


def _count(text: str | None) -> int:
    return len([part for part in str(text or "").split(",") if part.strip()])


def check_sizes(args: argparse.Namespace) -> None:
    """SizeLimitError (or DataError for a value below its floor) for any out-of-range size option."""
    force = bool(getattr(args, "force_size", False))
    for dest, (flag, floor, ceiling, unit) in SIZE_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if value < floor:
            raise DataError(f"{flag} must be at least {floor}, got {value}")
        if ceiling is not None:
            check_at_most(value, getattr(LIMITS, ceiling), f"{flag} {value:,}" + (f" ({unit})" if unit else ""), force)
    for prefix in ("", "eval_"):
        samples, seq_len = getattr(args, f"{prefix}samples", None), getattr(args, f"{prefix}seq_len", None)
        if samples is None or seq_len is None:
            continue
        flag = "--" + prefix.replace("_", "-")
        names = (f"{flag}samples", f"{flag}seq-len", "--batch-size")
        check_windows(samples, seq_len, getattr(args, "batch_size", None) or 1, names, force)
    if getattr(args, "rates", None) is not None:
        check_at_most(_count(args.rates), LIMITS.rates, f"--rates lists {_count(args.rates):,} rates, which", force)
    for dest, flag in (("budgets", "--budgets"), ("refine_budgets", "--refine-budgets")):
        if getattr(args, dest, None) is not None:
            check_at_most(_count(getattr(args, dest)), LIMITS.budgets, f"{flag} lists {_count(getattr(args, dest)):,} budgets, which", force)


def check_sources(args: argparse.Namespace) -> None:
    """DataError when --data or --eval-data names no text source (``--data ""`` measures nothing)."""
    for dest, flag in (("data", "--data"), ("eval_data", "--eval-data")):
        if hasattr(args, dest) and _count(getattr(args, dest)) == 0:
            raise DataError(f"{flag} names no text source; give wiki-sample, news-sample, a .txt/.jsonl file or an HF spec")


def check_out(args: argparse.Namespace) -> None:
    """OutputError unless --out can be written as what the command writes there."""
    out = getattr(args, "out", None)
    if out is None:
        return
    folder = args.command in FOLDER_OUTPUTS or (args.command == "export" and getattr(args, "format", None) == "hf")
    path = check_output(out, folder=folder)
    if folder and path.is_dir() and any(path.iterdir()) and not (path / CHECKPOINT_MARKER).is_file():
        raise OutputError(f"--out {path} is a folder that is neither empty nor a gap checkpoint; refusing to replace it")


def check_cache(args: argparse.Namespace) -> None:
    """CacheError now, not after a text source was read, when the command needs a cache root it cannot have."""
    uses_cache = (
        args.command in CACHE_COMMANDS
        or getattr(args, "model", None) in BUILTIN_NAMES
        or getattr(args, "run", None) is not None  # `gap report --run`: the run history
    )
    if uses_cache:
        cache_root()


def preflight(args: argparse.Namespace) -> None:
    """Every check above, in the order a user fixes them: sizes, sources, output, cache."""
    check_sizes(args)
    check_sources(args)
    check_out(args)
    check_cache(args)
