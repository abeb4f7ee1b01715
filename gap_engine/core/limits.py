"""Ceilings on every resource-sized input: tokens, windows, buckets, search length, file sizes.

A careless or hostile value (``--seq-len 100000``, ``--n-buckets 100000000``, a 2 GB "plan")
would otherwise run for minutes and take gigabytes before failing, or take the machine down.
Each ceiling below is sized from what the work needs on the machine this project targets (two
CPU cores, 8-24 GB of memory) with the largest built-in model (gemma3-270m: 262,144-token
vocabulary, 18 blocks of width 640; smollm2-135m: 30 blocks of width 576) and sits well
above every default. A value past a ceiling is refused with one line that names the limit
and how to lift it: ``--force-size`` on the command line, or ``GAP_FORCE_SIZE=1`` in the
environment (which also lifts the file-size ceilings the readers apply).

This module imports nothing heavy: the CLI checks its arguments against it before torch loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gap_engine.core.errors import SizeLimitError

FORCE_ENV = "GAP_FORCE_SIZE"  # "1" lifts every ceiling of this module
FORCE_HINT = f"pass --force-size or set {FORCE_ENV}=1 to go past it"
MiB = 1 << 20


@dataclass(frozen=True)
class SizeLimits:
    """The ceilings; each comment says what a value at the ceiling costs."""

    seq_len: int = 8192  # tokens per window: smollm2's whole position range; eager attention of one window then needs ~2.4 GB
    samples: int = 2048  # windows per text source (128x the app's default)
    window_tokens: int = 131072  # samples x seq_len: an exact table keeps every block's input, ~9 GB for smollm2 at this size
    batch_tokens: int = 4096  # batch_size x seq_len per forward pass: gemma3's float32 logits alone take 4.3 GB per copy
    batch_size: int = 256  # windows per forward pass
    n_buckets: int = 262144  # DP budget resolution: (components x buckets) int16 back-pointers, 31 MB for smollm2
    rates: int = 256  # rates on a table's grid: each is a column of cells to measure
    budgets: int = 64  # budgets of one `gap compare`: each is a prune and an evaluation per allocator
    evo_generations: int = 1000  # evolutionary rounds: each scores evo_offspring candidates on the calibration windows
    evo_offspring: int = 256  # candidates per round
    ray_workers: int = 64  # Ray worker processes of one table build: each holds a copy of the model
    rounds: int = 16  # rounds of `gap prune --budget`: each builds a loss table of the whole model and prunes it
    generations: int = 64  # greedy generations of `gap eval` (it has 3 prompts; more repeat nothing)
    channel_multiple: int = 4096  # MLP width granularity: wider than any MLP of the supported families
    layers: int = 4096  # blocks a plan or table may describe
    seed: int = 2**32 - 1  # the largest seed numpy's generators take without wrapping
    plan_bytes: int = 1 * MiB  # a plan file: one for 4096 layers is ~200 kB
    table_bytes: int = 64 * MiB  # a loss table file: one for smollm2 at 16 rates is ~200 kB
    metadata_bytes: int = 1 * MiB  # config.json, gap_pruned.json, gap_converted.json, cache meta.json
    partial_bytes: int = 64 * MiB  # a build's partial cells
    text_bytes: int = 256 * MiB  # a local .txt/.jsonl text source (about 60 million tokens)
    upload_bytes: int = 64 * MiB  # one file uploaded to the explorer (calibration text or plan)
    json_depth: int = 32  # nesting of any JSON/YAML document we read (a table is 3 deep)
    teacher_tokens: int = 1 << 20  # tokens of teacher-written recovery text: ~1.5 h of generation by smollm2-135m on one core
    teacher_seconds: int = 3600  # writing teacher text, as the cost model prices it on this machine (pipeline.cost_model)
    text_field: int = 512  # characters of a short text field (a model name or path, a key, a date)


LIMITS = SizeLimits()


def forced() -> bool:
    """True when the environment lifts the ceilings (GAP_FORCE_SIZE=1)."""
    return os.environ.get(FORCE_ENV, "").strip().lower() in ("1", "true", "yes")


def check_at_most(value: int, limit: int, what: str, force: bool = False, advice: str = "", from_file: bool = False) -> None:
    """SizeLimitError unless ``value <= limit`` (or the ceilings are lifted).

    Args:
        value: the requested size.
        limit: its ceiling (a field of ``LIMITS``).
        what: how the user names it, e.g. "--seq-len 100000 (tokens per window)".
        force: True when the caller's own --force-size flag was given.
        advice: what else the user can do, e.g. "lower --batch-size".
        from_file: the size was read from a file, which only the environment variable lifts.
    """
    if value > limit and not (force or forced()):
        hint = f"set {FORCE_ENV}=1 to read it anyway" if from_file else FORCE_HINT
        raise SizeLimitError(f"{what} is above the limit of {limit:,}; {advice + ', or ' if advice else ''}{hint}")


def check_windows(
    n_samples: int,
    seq_len: int,
    batch_size: int,
    names: tuple[str, str, str] = ("--samples", "--seq-len", "--batch-size"),
    force: bool = False,
) -> None:
    """SizeLimitError for window sizes past their ceilings, alone or multiplied together.

    Args:
        n_samples, seq_len, batch_size: the windows a stage would read.
        names: how the user sets the three (flags, or the app's labels), for the message.
        force: the caller's --force-size.
    """
    samples_name, seq_name, batch_name = names
    check_at_most(n_samples, LIMITS.samples, f"{samples_name} {n_samples:,} (windows)", force)
    check_at_most(seq_len, LIMITS.seq_len, f"{seq_name} {seq_len:,} (tokens per window)", force)
    check_at_most(batch_size, LIMITS.batch_size, f"{batch_name} {batch_size:,} (windows per forward pass)", force)
    total = n_samples * seq_len
    check_at_most(total, LIMITS.window_tokens, f"{samples_name} x {seq_name} = {total:,} tokens", force)
    per_pass = min(batch_size, n_samples) * seq_len
    what = f"{batch_name} x {seq_name} = {per_pass:,} tokens in one forward pass"
    check_at_most(per_pass, LIMITS.batch_tokens, what, force, advice=f"lower {batch_name} (it never changes a number)")


def check_file_size(size: int, limit: int, what: str, error: type = SizeLimitError) -> None:
    """``error`` unless a file of ``size`` bytes is within ``limit`` (or the ceilings are lifted)."""
    if size > limit and not forced():
        raise error(
            f"{what} is {size / MiB:.1f} MB, above the limit of {limit / MiB:.0f} MB for this kind of file; "
            f"set {FORCE_ENV}=1 to read it anyway"
        )
