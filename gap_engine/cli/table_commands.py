"""``gap table`` and ``gap cache``: build loss tables and manage the table cache.

A table already in the cache is found before anything loads (``tables.lookup``), so the
modules that load models and read text (and torch with them) are imported only when a table
must be built.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gap_engine.cli.arguments import device_from, spec_from_args
from gap_engine.cli.output import StderrProgress
from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import InvariantError, TableError
from gap_engine.core.fsutil import atomic_write_text
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.tables.artefact import LossTable, TableSpec
from gap_engine.tables.cache import list_tables, remove_table
from gap_engine.tables.lookup import find_table


def read_sources(*specs: str) -> None:
    """Read every text source named in ``specs`` now, so a bad one fails before a model loads.

    Reading is cheap next to a model load, and the corpus of a built-in source is kept for
    the stage that cuts its windows.
    """
    from gap_engine.data.windows import load_corpus

    for spec in specs:
        for source in WindowSpec(data=spec).sources():
            load_corpus(source)


def check_windows_fit(model: str, *needs: tuple[WindowSpec, str]) -> None:
    """DataError before any text is announced or a model loads, when a text source has too few
    tokens in this model's tokenizer for one window: each need is (windows, a part: "calibration",
    "selection", "report", or "heldout" for the part held-out windows read by default). Skipped where the tokenizer does not load cheaply (``load_tokenizer``): the
    windows then say it once the model is loaded."""
    from gap_engine.data.windows import check_enough_tokens
    from gap_engine.model.loading import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        return
    for windows, part in needs:
        check_enough_tokens(tokenizer, windows, part)


def run_table(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    if args.dry_run:
        return run_dry_run(args, spec)
    if not args.out:
        raise TableError("--out is required (or --dry-run to see what the build would cost)")
    out = Path(args.out)
    if out.suffix not in (".json", ".csv"):
        raise TableError(f"--out must end in .json or .csv, got '{out.name}'")
    if out.is_dir():
        raise TableError(f"--out {out} is a folder; give a file name")
    if (
        args.ray is not None and spec.estimator != "exact"
    ):  # the engine refuses it too (pipeline.stages.loss_table); here before the model loads
        raise TableError(f"--ray spreads measured cells; the {spec.estimator} estimate is one gradient pass in one process")
    # A refit's calibration rule needs the model's widths: such a table is looked up once the model
    # is loaded (loss_table checks the rule, then reads the cache), never served before the check.
    refits = CompensationSettings(mode=spec.compensation).refits
    table = None if args.no_cache or refits else find_table(args.model, spec, device_from(args))
    if table is None:
        table = build_table(args, spec)
    atomic_write_text(out, table.to_csv() if out.suffix == ".csv" else table.to_json())
    measured = int(table.measured_cells()[table.removed > 0].sum())
    print(
        f"wrote {out}: {len(table.components)} components x {len(table.rate_grid)} rates "
        f"({measured} of {int((table.removed > 0).sum())} cells measured, the rest estimated), "
        f"dense {spec.objective} {table.dense_objective:.4f}, windows start with {table.window_start}, key {table.key}"
    )
    return 0


def build_table(args: argparse.Namespace, spec: TableSpec) -> LossTable:
    """The table the long way: check and read the text, load the model, then `loss_table`
    (which still reads the cache first, under the key of the loaded model)."""
    from gap_engine.model.loading import load_model
    from gap_engine.pipeline.stages import loss_table

    check_windows_fit(args.model, (spec.windows, "calibration"))
    read_sources(spec.windows.data)
    cells = ray_cells(args, spec)
    lm = load_model(args.model, device_from(args))
    unit = {"exact": "cells", "refine": "batches, then cells"}.get(spec.estimator, "batches")
    progress = StderrProgress(f"table {unit}")
    return loss_table(lm, spec, progress.hooks(), use_cache=not args.no_cache, cells=cells)


def ray_cells(args: argparse.Namespace, spec: TableSpec):
    """The Ray cell executor ``--ray`` asks for, or None (ray is imported only when asked for)."""
    if args.ray is None:
        return None
    from gap_engine.tables.distributed import RayCells, RaySettings

    settings = RaySettings(address=None if args.ray == "local" else args.ray, workers=args.ray_workers)
    return RayCells(settings.validate())


def run_dry_run(args: argparse.Namespace, spec: TableSpec) -> int:
    """Print the cost model's prediction for this build (nothing is built)."""
    from gap_engine.pipeline.cost_model import predict_build
    from gap_engine.views.estimate_text import estimate_lines

    if args.ray_workers < 1:
        raise TableError(f"--ray-workers must be at least 1, got {args.ray_workers}")
    workers = args.ray_workers if args.ray is not None else 1
    estimate = predict_build(args.model, spec, device_from(args), workers, profile=args.profile)
    if estimate is None:
        raise InvariantError("the cost model gave no prediction (measure=True always gives one)")
    print("\n".join(estimate_lines(estimate)))
    return 0


def run_cache_ls(args: argparse.Namespace) -> int:
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
    remove_table(args.key)
    print(f"removed {args.key}")
    return 0
