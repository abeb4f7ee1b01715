"""Quality benchmark: GAP's DP against the baselines at equal budget, every method with the same menu.

For every budget and allocator the plan is made once; then a copy of the model is pruned for
real with every compensation the plan's criterion can take (``dp``, ``uniform``, ``flap``: none,
bias, refit, bias+refit; ``slimgpt``, whose OBS update is its own compensation: none, and bias on
top) and measured, window by window, on the two parts of the held-out text of every source. A menu entry
``NAME:norm`` is compensation NAME fitted through the norms after o_proj and down_proj (the
output-norm weighting, Gemma 3's post-norms; OBS's bias too):

- the **selection** part (``--selection-windows`` per source) measures every compensation and
  chooses each method's best at each budget: the lowest mean KL to dense over the sources;
- the **report** part (``--report-windows`` per source, at least 24) then measures each method at
  its best and at its shipped default (bias; none for slimgpt; ``--report-every-row``: every
  compensation), and gives every number the report prints: those rows, and the margins of DP
  (default and best) over every baseline at its best, each with a paired bootstrap interval over
  the report windows (``gap_engine.evaluate.intervals``). The default and the best so far stay in
  memory until the choice is made, so no model is pruned twice.

Per-window NLL, KL(dense || pruned) and top-1 agreement go into ``<name>.jsonl``, one line per
measurement as soon as it is made, so a killed run continues where it stopped (same settings;
``--fresh`` starts over). ``<name>.md`` (the report) and ``<name>.csv`` (means per row,
part and source) are regenerated whole from it at the end; the report's first line is the
command that regenerates it, every setting spelled out, and ``<name>.commands.json`` keeps its argv.

Task accuracy (``gap_wiki_next``, lm-eval) is off by default: ``--task-limit 500`` scores each
method's best and default at every budget on its 500 examples (fewer examples are refused: a task
claim needs at least 500).

    python bench/bench_quality.py --model smollm2-135m --name quality
"""

from __future__ import annotations

import argparse
import csv
import gc
import io
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_report import (
    MIN_TASK_EXAMPLES,
    TASK,
    Group,
    best_measured,
    best_on_selection,
    budgets_of,
    mean_kl,
    report_text,
    row_key,
    set_name,
    sources_of,
    split_list,
)
from report import RESULTS, machine_line, with_header

from gap_engine.core.config import BUILTIN_TEXT_NAMES, CLI_TABLE, DEFAULT_SAVE_DTYPE, HELDOUT_SPLITS
from gap_engine.prune.compensations import COMPENSATIONS, adds_biases

log = logging.getLogger("bench_quality")
MIN_REPORT_WINDOWS = 24  # the paired bootstrap's minimum per source
DEFAULT_ALLOCATORS = ("dp", "uniform", "flap", "slimgpt")
SCRIPT = "python bench/bench_quality.py"

# Every option that changes a measured number or what the report holds; the command written at
# the top of the report spells each one out, so a later change of a default cannot change it.
SETTINGS = (
    "model",
    "data",
    "estimator",
    "objective",
    "samples",
    "seq_len",
    "obs_samples",
    "fit_samples",
    "rates",
    "criterion",
    "budgets",
    "allocators",
    "compensations",
    "eval_data",
    "selection_windows",
    "report_windows",
    "eval_seq_len",
    "window_seed",
    "task_limit",
    "report_every_row",
    "resamples",
    "bootstrap_seed",
    "name",
)
# What every measured row depends on: a JSONL made with other values of these is not resumed.
MEASUREMENT = (
    "model",
    "data",
    "estimator",
    "objective",
    "samples",
    "seq_len",
    "fit_samples",
    "rates",
    "criterion",
    "eval_data",
    "selection_windows",
    "report_windows",
    "eval_seq_len",
    "window_seed",
)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``tests/bench`` runs it on the command a result file records)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=CLI_TABLE.windows.data, help="calibration text (the table's, compensation's, FLAP's and OBS's)")
    p.add_argument("--estimator", default=CLI_TABLE.estimator)
    p.add_argument("--objective", default=CLI_TABLE.objective)
    p.add_argument("--samples", type=int, default=CLI_TABLE.windows.n_samples, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=CLI_TABLE.windows.seq_len, help="tokens per calibration window")
    p.add_argument(
        "--obs-samples",
        type=int,
        help="calibration windows of the same text every plan pruned by OBS reads (slimgpt, a dp whose step is OBS, X:obs); "
        "default: the tool's (config.obs_window_count: 4x --samples, at most 128)",
    )
    p.add_argument(
        "--fit-samples",
        type=int,
        help="calibration windows of the same text every compensation after a cut is fitted on (bias, refit; OBS's own "
        "bias reads --obs-samples); default: the calibration windows themselves (--samples), whatever the model family's default",
    )
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in CLI_TABLE.rate_grid), help="the table's rate grid")
    p.add_argument("--criterion", default="wanda", help="the table's criterion (dp and uniform prune by it)")
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.4,0.5")
    p.add_argument(
        "--allocators",
        default=",".join(DEFAULT_ALLOCATORS),
        help="comma-separated, each ALLOCATOR or ALLOCATOR:CRITERION (dp:obs: DP's plan pruned by OBS); dp first",
    )
    p.add_argument(
        "--compensations",
        default=",".join(COMPENSATIONS),
        help="the menu, comma-separated; each allocator gets every one its criterion can take (obs: none, bias)",
    )
    p.add_argument("--eval-data", default=",".join(BUILTIN_TEXT_NAMES), help="held-out sources, comma-separated")
    p.add_argument("--selection-windows", type=int, default=16, help="held-out windows per source that choose")
    p.add_argument("--report-windows", type=int, default=MIN_REPORT_WINDOWS, help="held-out windows per source that report")
    p.add_argument("--eval-seq-len", type=int, default=256, help="tokens per held-out window")
    p.add_argument("--window-seed", type=int, default=0, help="which held-out windows are drawn")
    p.add_argument(
        "--task-limit",
        type=int,
        default=0,
        help=f"examples of {TASK} per method's best and default (0: no task; else at least {MIN_TASK_EXAMPLES})",
    )
    p.add_argument(
        "--report-every-row", action="store_true", help="measure every compensation on the report part, not only the best and default"
    )
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--eval-batch-size", type=int, default=1, help="windows per forward pass (memory only)")
    p.add_argument("--name", default="quality", help="files bench/results/<name>.md, .jsonl, .csv, .commands.json")
    p.add_argument("--fresh", action="store_true", help="discard <name>.jsonl and measure everything again")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if 0 < args.task_limit < MIN_TASK_EXAMPLES:
        p.error(f"--task-limit {args.task_limit}: a task claim needs at least {MIN_TASK_EXAMPLES} examples (0: no task)")
    if args.obs_samples is None:  # what the tool ships, so a default run measures it
        from gap_engine.core.config import obs_window_count

        args.obs_samples = obs_window_count(args.samples, None)
    if args.obs_samples < 1:
        p.error(f"--obs-samples {args.obs_samples}: OBS needs at least one window")
    if args.fit_samples is not None and args.fit_samples < 1:
        p.error(f"--fit-samples {args.fit_samples}: a fit needs at least one window")
    if args.report_windows < MIN_REPORT_WINDOWS:
        p.error(f"--report-windows {args.report_windows}: the paired bootstrap needs at least {MIN_REPORT_WINDOWS} per source")
    for name in ("budgets", "allocators", "compensations", "eval_data"):
        if not split_list(getattr(args, name)):
            p.error(f"--{name.replace('_', '-')} is empty")
    unknown = [c for c in split_list(args.compensations) if not is_menu_entry(c)]
    if unknown:
        p.error(
            f"--compensations: unknown {unknown[0]!r}; choose from {', '.join(COMPENSATIONS)}, "
            f"each but none also as NAME{NORM} (fitted through the output norms)"
        )
    if split_list(args.allocators)[0] != "dp":
        p.error("--allocators must start with dp: the report's margins are DP's")
    from gap_engine.core.errors import GapError
    from gap_engine.pipeline.compare import allocator_spec

    for spec in split_list(args.allocators):
        try:
            allocator_spec(spec)
        except GapError as exc:
            p.error(f"--allocators: {exc}")
    return args


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key) for key in SETTINGS}


def command_argv(args: argparse.Namespace) -> list[str]:
    """The argv that regenerates the report whole: every setting spelled out."""
    argv = []
    for key in SETTINGS:
        value = getattr(args, key)
        if isinstance(value, bool):
            argv += [f"--{key.replace('_', '-')}"] if value else []
        elif value is not None:  # an option left to the tool's default (--fit-samples) is not spelled
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def command_line(args: argparse.Namespace) -> str:
    return " ".join([SCRIPT, *(shlex.quote(part) for part in command_argv(args))])


NORM = ":norm"  # a menu entry's mark: its compensation fitted through the output norms (weighting "output-norm")


def is_menu_entry(entry: str) -> bool:
    """Whether ``entry`` names a compensation (``bias``) or one fitted through the output norms (``bias:norm``)."""
    mode, mark, tag = entry.partition(":")
    return mode in COMPENSATIONS and (not mark or (tag == NORM[1:] and mode != "none"))


def menu_settings(entry: str, samples: int | None):
    """The CompensationSettings a menu entry prunes with, fitted on ``samples`` windows (None: the calibration's)."""
    from gap_engine.prune.compensations import CompensationSettings

    mode = entry.partition(":")[0]
    return CompensationSettings(mode=mode, samples=samples, weighting="output-norm" if entry.endswith(NORM) else "tokens")


def menu_name(settings) -> str:
    """The menu entry of a CompensationSettings (``menu_settings``' inverse, windows aside)."""
    return settings.mode + (NORM if settings.weighted else "")


def compensations_for(sequential: bool, menu: Sequence[str]) -> list[str]:
    """The compensations of ``menu`` a plan can take: all of them, or for a criterion that chooses
    while pruning (``obs``) those that may follow its own update (none, bias, bias:norm)."""
    from gap_engine.prune.sequential import OBS_COMPENSATIONS

    return [c for c in menu if not sequential or c.partition(":")[0] in OBS_COMPENSATIONS]


def default_compensation(criterion: str, model_type: object) -> str:
    """What the method ships with when nobody tunes it (``prune.compensations.default_for``: the
    model family's default, none after OBS), as a menu entry."""
    from gap_engine.prune.compensations import default_for

    return menu_name(default_for(criterion, model_type))


# ---- the results file: one JSON object a line ---------------------------------------------------
class Results:
    """``<name>.jsonl``: the settings, then the dense numbers, rows and task scores as they come."""

    def __init__(self, path: Path, args: argparse.Namespace):
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.appended = 0  # measurements this run made (the rest of ``records`` was read back)
        wanted = {key: getattr(args, key) for key in MEASUREMENT}
        if path.exists() and not args.fresh:
            self.records = read_records(path)
            found = next((r["settings"] for r in self.records if r.get("kind") == "settings"), None)
            if found is not None and {k: found.get(k) for k in MEASUREMENT} != wanted:
                differ = [k for k in MEASUREMENT if found.get(k) != wanted[k]]
                raise SystemExit(f"{path} was measured with other settings ({', '.join(differ)}): use --fresh, or another --name")
            log.info("resuming %s: %d rows measured", path, sum(1 for r in self.records if r.get("kind") == "row"))
        if not self.records:
            RESULTS.mkdir(exist_ok=True)
            path.write_text("")
            self.append({"kind": "settings", "settings": wanted})

    def adopt(self, labels: dict[tuple[float, str, str], str], obs_samples: int, samples: int) -> None:
        """Name every measured record by the requested allocator that measured it: a row is what was
        pruned (budget, base allocator, criterion; ``labels`` maps these to the names asked for), not
        the name it was asked under. A bare ``dp`` prunes by its model family's step, so a row
        measured as ``dp:obs`` is ``dp`` on a family whose step is OBS, and one measured as ``dp``
        before that step was the default is ``dp:wanda``. A record pruned by OBS is of ``obs_samples``
        windows (one that does not say read ``samples``, the calibration's). A report or task that
        does not say its criterion is of the last row before it measured under its name (its own: a
        report follows its row), else of the criterion its name spells (``dp:wanda``). Records of
        nothing requested are set aside here (the file keeps them)."""
        from gap_engine.prune.criteria import is_sequential

        latest: dict[tuple[float, str, str], str] = {}  # row_key -> criterion of the last row so far
        kept = []
        for record in self.records:
            if record.get("kind") not in ("row", "report", "task") or record.get("allocator") == "dense":
                kept.append(record)
                continue
            named = str(record["allocator"]).partition(":")[2] or None
            criterion = record.get("criterion") or latest.get(row_key(record)) or named
            if record.get("kind") == "row":
                latest[row_key(record)] = str(criterion)
            if is_sequential(str(criterion)) and record.get("obs_samples", samples) != obs_samples:
                continue
            label = labels.get((record["budget"], str(record["allocator"]).partition(":")[0], str(criterion)))
            if label is not None:
                kept.append(record | {"allocator": label})
        self.records = kept

    def append(self, record: dict[str, Any]) -> None:
        self.appended += record.get("kind") in ("row", "report")
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)

    def rows(self) -> list[dict[str, Any]]:
        """Every measured row, with its report windows where they were measured."""
        reports = {row_key(r): r["windows"] for r in self.records if r.get("kind") == "report"}
        rows = []
        for record in self.records:
            if record.get("kind") == "row":
                rows.append(record | {"windows": record["windows"] | reports.get(row_key(record), {})})
        return rows

    def has_report(self, budget: float, allocator: str, compensation: str) -> bool:
        return any(r.get("kind") == "report" and row_key(r) == (budget, allocator, compensation) for r in self.records)

    def row(self, budget: float, allocator: str, compensation: str) -> dict[str, Any] | None:
        key = (budget, allocator, compensation)
        return next((r for r in self.records if r.get("kind") == "row" and row_key(r) == key), None)

    def dense(self) -> dict[str, Any] | None:
        return next((r for r in self.records if r.get("kind") == "dense"), None)

    def tasks(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == "task"]


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole line of a results file; a last line a kill cut short is dropped (and rewritten)."""
    records, text = [], path.read_text()
    lines = text.splitlines()
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines) - 1:
                raise SystemExit(f"{path} line {number + 1} is not JSON: not a results file of this benchmark") from None
            log.warning("%s: the last line was cut short by a kill; dropped", path)
            path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return records


# ---- measuring ----------------------------------------------------------------------------------------
class Run:
    """One model's benchmark: its table, calibration and held-out windows, dense numbers and plans."""

    def __init__(self, args: argparse.Namespace, results: Results):
        import torch

        from gap_engine.core.config import WindowSpec
        from gap_engine.core.progress import Hooks
        from gap_engine.data.windows import calibration_windows, heldout_windows
        from gap_engine.evaluate.window_metrics import dense_windows, head_weight
        from gap_engine.model.loading import load_model
        from gap_engine.model.storage import parse_dtype
        from gap_engine.pipeline.stages import loss_table
        from gap_engine.tables.artefact import TableSpec, parse_rate_grid

        self.args, self.results = args, results
        self.sources = sources_of(args)
        self.dense = load_model(args.model)
        from gap_engine.model.adapters import has_output_norms

        weighted = [c for c in split_list(args.compensations) if c.endswith(NORM)]
        if weighted and not has_output_norms(self.dense.model_type):
            raise SystemExit(f"--compensations {weighted[0]}: {args.model}'s blocks have no norm after o_proj and down_proj to fit through")
        self.calib = WindowSpec(data=args.data, n_samples=args.samples, seq_len=args.seq_len, batch_size=8)
        spec = TableSpec(
            windows=self.calib,
            criterion=args.criterion,
            rate_grid=parse_rate_grid(args.rates),
            estimator=args.estimator,
            objective=args.objective,
        )
        started = time.perf_counter()
        self.table = loss_table(self.dense, spec, hooks=Hooks(progress=lambda d, t, eta: None))
        log.info("loss table ready in %.0f s", time.perf_counter() - started)
        self.windows = calibration_windows(self.dense.tokenizer, self.calib)
        counts = {"selection": args.selection_windows, "report": args.report_windows}
        sets = {
            set_name(split, source): heldout_windows(
                self.dense.tokenizer,
                WindowSpec(data=source, n_samples=counts[split], seq_len=args.eval_seq_len, seed=args.window_seed),
                split,
            )
            for split in HELDOUT_SPLITS
            for source in self.sources
        }
        self.split_sets = {split: {n: w for n, w in sets.items() if n.startswith(f"{split}/")} for split in HELDOUT_SPLITS}
        self.scores: dict[str, Any] = {}
        self.plans: dict[tuple[float, str], Any] = {}
        if results.dense() is None:
            # Every pruned model is stored (and measured) in the storage dtype: its head is the dense
            # head rounded so, and the dense side of the KL is computed once under that head.
            stored_head = head_weight(self.dense).detach().to(parse_dtype(DEFAULT_SAVE_DTYPE)).to(torch.float32)
            started = time.perf_counter()
            dense = {name: dense_windows(self.dense, w, stored_head, args.eval_batch_size).nll.tolist() for name, w in sets.items()}
            log.info("dense numbers on %d window sets in %.0f s", len(sets), time.perf_counter() - started)
            results.append({"kind": "dense", "windows": {name: {"nll": nll} for name, nll in dense.items()}})
        self.tasks = None
        if args.task_limit:
            from gap_engine.evaluate.tasks import prepare_tasks, task_settings

            self.tasks = prepare_tasks(task_settings(TASK, limit=args.task_limit))

    def scores_for(self, criterion: str):
        from gap_engine.prune.criteria import is_sequential
        from gap_engine.prune.importance import compute_importance

        if is_sequential(criterion):
            return None
        if criterion not in self.scores:
            self.scores[criterion] = compute_importance(self.dense, self.windows, criterion, self.calib.batch_size)
        return self.scores[criterion]

    def plan(self, budget: float, allocator: str, compensation: str = "none"):
        """The allocator's plan at the budget for a prune followed by ``compensation``: a plan
        whose prune adds biases pays for them from the budget (``plan.problem.bias_charges``), so
        every row ships the same net parameters; made once per budget, allocator and whether
        biases are added (the compensations without biases prune the same units)."""
        from gap_engine.pipeline.compare import allocator_spec
        from gap_engine.pipeline.stages import pruned_by
        from gap_engine.plan.allocator_registry import needs_windows
        from gap_engine.plan.allocators import plan_from_table

        counted = "bias" if adds_biases(compensation.partition(":")[0]) else "none"
        key = (budget, allocator, counted)
        if key not in self.plans:
            base, criterion = allocator_spec(allocator)  # dp:obs: DP's rates, pruned by OBS
            windows = self.windows if needs_windows(base) else None
            scores = self.scores_for(self.table.spec.criterion)
            plan = plan_from_table(self.dense, self.table, budget, base, windows=windows, scores=scores, compensation=counted)
            self.plans[key] = pruned_by(plan, criterion)
            if self.plans[key].criterion != self.step(allocator):
                raise SystemExit(f"{allocator}'s plan is pruned by {self.plans[key].criterion}, its records say {self.step(allocator)}")
        return self.plans[key]

    def step(self, allocator: str) -> str:
        """What the allocator's plans are pruned by (``plan.step``), known before any is made: a resumed run plans
        only what it still has to prune."""
        from gap_engine.pipeline.compare import allocator_spec
        from gap_engine.plan.step import plan_criterion

        base, criterion = allocator_spec(allocator)
        return criterion or plan_criterion(base, self.table)

    def group(self, budget: float, allocator: str) -> Group:
        from gap_engine.prune.criteria import is_sequential

        criterion = self.step(allocator)
        menu = tuple(compensations_for(is_sequential(criterion), split_list(self.args.compensations)))
        default = default_compensation(criterion, self.dense.model_type)
        return Group(budget, allocator, menu, default, criterion)

    def pruned(self, budget: float, allocator: str, compensation: str):
        """A copy of the model pruned by the plan with the compensation, as a checkpoint stores it: a compensation
        after the cut fitted on ``--fit-samples`` windows (OBS fits its own bias on its windows)."""
        from gap_engine.pipeline.stages import pruned_as_saved
        from gap_engine.prune.compensations import fitted_after_cut

        plan = self.plan(budget, allocator, compensation)
        fitted = fitted_after_cut(plan.criterion, compensation.partition(":")[0])
        return pruned_as_saved(
            self.dense,
            plan,
            self.calib,
            scores=self.scores_for(plan.criterion),
            # none asked: the calibration's own windows, spelled out, not a model family's default floor (64 on Gemma 3),
            # so a file's command measures what its settings say whatever the default becomes
            compensation=menu_settings(compensation, (self.args.fit_samples or self.args.samples) if fitted else None),
            obs_samples=self.args.obs_samples,
        )

    def step_record(self, budget: float, allocator: str) -> dict[str, Any]:
        """What every record of a plan says of its step: its criterion and, pruned by OBS, the windows OBS read."""
        from gap_engine.prune.criteria import is_sequential

        criterion = self.step(allocator)
        return {"criterion": criterion} | ({"obs_samples": self.args.obs_samples} if is_sequential(criterion) else {})

    def measure_selection(self, budget: float, allocator: str, compensation: str) -> tuple[Any, dict[str, Any]]:
        """(the pruned model, its row: what the plan removed and its numbers on the selection windows)."""
        from gap_engine.evaluate.window_metrics import window_numbers

        load_start, started = os.getloadavg()[0], time.perf_counter()
        pruned, result = self.pruned(budget, allocator, compensation)
        prune_s = time.perf_counter() - started
        numbers = window_numbers(pruned, self.dense, self.split_sets["selection"], self.args.eval_batch_size)
        plan = result.plan
        row = {
            "kind": "row",
            "model": self.args.model,
            "budget": budget,
            "allocator": allocator,
            "criterion": plan.criterion,
            "compensation": compensation,
            "removed": int(plan.params["removed"]),
            "removed_fraction": float(plan.params["removed_fraction_of_prunable"]),
            "params_after": int(result.params_after),
            "bias_params": int((result.compensation or {}).get("bias_params", 0)),
            # what the shipped model lost, biases counted: the budget every row is planned to meet
            "net_removed_fraction": (result.params_before - result.params_after) / int(plan.params["dense_prunable"]),
            "windows": {name: {"nll": n.nll, "kl": n.kl, "top1": n.top1} for name, n in numbers.items()},
            "prune_s": round(prune_s, 1),
            "eval_s": round(time.perf_counter() - started - prune_s, 1),
            "load_start": round(load_start, 2),
            "load_end": round(os.getloadavg()[0], 2),
        } | self.step_record(budget, allocator)
        return pruned, row

    def measure_report(self, pruned: Any, budget: float, allocator: str, compensation: str) -> dict[str, Any]:
        """A pruned model's numbers on the report windows."""
        from gap_engine.evaluate.window_metrics import window_numbers

        load_start, started = os.getloadavg()[0], time.perf_counter()
        numbers = window_numbers(pruned, self.dense, self.split_sets["report"], self.args.eval_batch_size)
        return {
            "kind": "report",
            "budget": budget,
            "allocator": allocator,
            "compensation": compensation,
            "windows": {name: {"nll": n.nll, "kl": n.kl, "top1": n.top1} for name, n in numbers.items()},
            "report_s": round(time.perf_counter() - started, 1),
            "report_load": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        } | self.step_record(budget, allocator)

    def task(self, budget: float, allocator: str, compensation: str) -> dict[str, Any]:
        from gap_engine.evaluate.tasks import run_tasks

        load_start, started = os.getloadavg()[0], time.perf_counter()
        pruned, _ = self.pruned(budget, allocator, compensation)
        score = run_tasks(pruned, self.tasks)[TASK]
        del pruned
        gc.collect()
        return {
            "kind": "task",
            "budget": budget,
            "allocator": allocator,
            "compensation": compensation,
            "acc": score.acc,
            "stderr": score.acc_stderr,
            "n": score.n,
            "task_s": round(time.perf_counter() - started, 1),
            "load_start": round(load_start, 2),
        } | self.step_record(budget, allocator)

    def dense_task(self) -> dict[str, Any]:
        from gap_engine.evaluate.tasks import dense_task_scores, run_tasks

        score = dense_task_scores(self.dense.fingerprint, "float32", self.tasks, lambda names: run_tasks(self.dense, self.tasks, names))[
            TASK
        ]
        return {
            "kind": "task",
            "budget": 0.0,
            "allocator": "dense",
            "compensation": "none",
            "acc": score.acc,
            "stderr": score.acc_stderr,
            "n": score.n,
        }


def measure_group(bench: Run, results: Results, group: Group, progress: Progress) -> None:
    """Every compensation of one allocator at one budget on the selection windows, then its default
    and its best on the report windows (every compensation with ``--report-every-row``).

    The models that may be reported (the default and the best so far) stay in memory until the
    choice is made; a resumed run prunes again only what it lost."""
    kept: dict[str, Any] = {}
    for compensation in group.menu:
        key = (group.budget, group.allocator, compensation)
        model = None
        if results.row(*key) is None:
            started = time.perf_counter()
            model, row = bench.measure_selection(*key)
            results.append(row)
            log.info(
                "%s %s at %.0f%%: selection KL %.4f (prune %.0f s, eval %.0f s) %s",
                group.allocator,
                compensation,
                100 * group.budget,
                mean_kl(row, "selection", bench.sources),
                row["prune_s"],
                row["eval_s"],
                progress.step(time.perf_counter() - started),
            )
        if model is not None:
            best = best_measured(group, results.rows(), bench.sources)
            wanted = {group.default, best["compensation"] if best else group.default}
            if bench.args.report_every_row:
                wanted.add(compensation)
            kept = {c: m for c, m in kept.items() if c in wanted}
            if compensation in wanted:
                kept[compensation] = model
        del model
        if bench.args.report_every_row:
            report(bench, results, group, compensation, kept, progress)
    best = best_on_selection(group, results.rows(), bench.sources)
    if best is not None:
        for compensation in dict.fromkeys([group.default, best["compensation"]]):
            report(bench, results, group, compensation, kept, progress)
    kept.clear()
    gc.collect()


def report(bench: Run, results: Results, group: Group, compensation: str, kept: dict[str, Any], progress: Progress) -> None:
    """One row on the report windows, unless measured already: its model from memory, else pruned again."""
    key = (group.budget, group.allocator, compensation)
    if results.has_report(*key):
        return
    started = time.perf_counter()
    model = kept.pop(compensation, None)
    if model is None:
        model, _ = bench.pruned(*key)
    record = bench.measure_report(model, *key)
    del model
    gc.collect()
    results.append(record)
    log.info(
        "%s %s at %.0f%%: report KL %.4f (eval %.0f s) %s",
        group.allocator,
        compensation,
        100 * group.budget,
        mean_kl(record, "report", bench.sources),
        record["report_s"],
        progress.step(time.perf_counter() - started),
    )


class Progress:
    """Rows done of rows planned, and an estimate of the time left from the rows this process measured."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.measured, self.seconds = total, done, 0, 0.0

    def step(self, seconds: float) -> str:
        self.done, self.measured, self.seconds = self.done + 1, self.measured + 1, self.seconds + seconds
        # Records read back may include reports a menu no longer plans (another default): never fewer planned than done.
        self.total = max(self.total, self.done)
        left = (self.total - self.done) * self.seconds / self.measured
        return f"[{self.done}/{self.total}, about {left / 60:.0f} min left]"


def run(args: argparse.Namespace) -> tuple[Results, list[Group]]:
    """Measure every row of the menu that the results file does not hold yet, then the tasks."""
    results = Results(RESULTS / f"{args.name}.jsonl", args)
    bench = Run(args, results)
    budgets, allocators = budgets_of(args), split_list(args.allocators)
    groups = [bench.group(budget, allocator) for budget in budgets for allocator in allocators]  # plans come when pruned
    labels: dict[tuple[float, str, str], str] = {}
    for group in groups:
        identity = (group.budget, group.allocator.partition(":")[0], group.criterion)
        if labels.setdefault(identity, group.allocator) != group.allocator:
            raise SystemExit(
                f"--allocators: {labels[identity]} and {group.allocator} prune the same plan by {group.criterion} here; name one"
            )
    results.adopt(labels, args.obs_samples, args.samples)
    reports = [len(g.menu) if args.report_every_row else min(2, len(g.menu)) for g in groups]
    progress = Progress(
        sum(len(g.menu) for g in groups) + sum(reports), len([r for r in results.records if r.get("kind") in ("row", "report")])
    )
    log.info("%d measurements planned (selection and report), %d made already", progress.total, progress.done)
    for group in groups:
        measure_group(bench, results, group, progress)
    if bench.tasks is not None:
        if not any(t["allocator"] == "dense" for t in results.tasks()):
            results.append(bench.dense_task())
        done = {(t["budget"], t["allocator"], t["compensation"]) for t in results.tasks()}
        for group in groups:
            best = best_on_selection(group, results.rows(), bench.sources)
            for compensation in dict.fromkeys([group.default, best["compensation"] if best else group.default]):
                if (group.budget, group.allocator, compensation) not in done and compensation in group.menu:
                    record = bench.task(group.budget, group.allocator, compensation)
                    results.append(record)
                    log.info(
                        "task %s %s at %.0f%%: %.3f (%d examples)",
                        group.allocator,
                        compensation,
                        100 * group.budget,
                        record["acc"],
                        record["n"],
                    )
    return results, groups


def csv_rows(rows: Sequence[dict[str, Any]], dense: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One CSV row per measured row, part and source: its window means (the windows are in the JSONL)."""
    import math

    out = []
    for row in rows:
        # selection before report, sources by name: the same file whether the rows were measured now or read back
        for name, numbers in sorted(row["windows"].items(), key=lambda item: (item[0].startswith("report/"), item[0])):
            split, source = name.split("/", 1)
            nll = sum(numbers["nll"]) / len(numbers["nll"])
            out.append(
                {
                    "budget": row["budget"],
                    "allocator": row["allocator"],
                    "criterion": row["criterion"],
                    "compensation": row["compensation"],
                    "split": split,
                    "source": source,
                    "windows": len(numbers["nll"]),
                    "ppl": round(math.exp(nll), 4),
                    "kl": round(sum(numbers["kl"]) / len(numbers["kl"]), 6),
                    "top1": round(sum(numbers["top1"]) / len(numbers["top1"]), 6),
                    "dense_ppl": round(math.exp(sum(dense["windows"][name]["nll"]) / len(dense["windows"][name]["nll"])), 4)
                    if dense
                    else "",
                    "removed_fraction": row["removed_fraction"],
                    "params_after": row["params_after"],
                    "bias_params": row["bias_params"],
                    "prune_s": row["prune_s"],
                    "eval_s": row["eval_s"],
                    "load_start": row["load_start"],
                    "load_end": row["load_end"],
                }
            )
    return out


def write_outputs(args: argparse.Namespace, results: Results, groups: Sequence[Group], machine: str) -> Path:
    from gap_engine.core.fsutil import atomic_write_text

    menu_keys = {(g.budget, g.allocator, c) for g in groups for c in g.menu}
    rows = [r for r in results.rows() if row_key(r) in menu_keys]
    report = report_text(args, command_line(args), machine, rows, groups, results.dense(), results.tasks())
    md_path = RESULTS / f"{args.name}.md"
    files = [f"{args.name}.{suffix}" for suffix in ("csv", "jsonl", "commands.json")]
    atomic_write_text(md_path, with_header(report, SCRIPT.split()[-1], command_argv(args), files))
    buffer = io.StringIO()
    table = csv_rows(rows, results.dense())
    if table:
        writer = csv.DictWriter(buffer, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    atomic_write_text(RESULTS / f"{args.name}.csv", buffer.getvalue())
    sidecar = {"command": command_line(args), "argv": [SCRIPT.split()[-1], *command_argv(args)], "machine": machine}
    atomic_write_text(RESULTS / f"{args.name}.commands.json", json.dumps(sidecar, indent=1) + "\n")
    return md_path


def measurements(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows (selection) and reports of a results file: what a run measures, one pruned model or evaluation each."""
    return [r for r in records if r.get("kind") in ("row", "report")]


def resumed_text(records: Sequence[dict[str, Any]], made_now: int) -> str:
    """What the machine line adds when measurements of ``records`` were read back rather than made by this run (it
    made ``made_now``): the run's own time is then not the file's, so the seconds every measurement recorded are summed."""
    made = measurements(records)
    earlier = len(made) - made_now
    if not earlier:
        return ""
    seconds = sum(r.get("prune_s", 0.0) + r.get("eval_s", 0.0) + r.get("report_s", 0.0) for r in made)
    return (
        f" {earlier} of the {len(made)} measurements were made by earlier runs of the same settings and read back; "
        f"the pruning and evaluation of all of them took {seconds:.0f} s."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    load_start, started = os.getloadavg(), time.perf_counter()
    results, groups = run(args)
    path = write_outputs(args, results, groups, machine_line(load_start, started) + resumed_text(results.records, results.appended))
    log.info("wrote %s (and .csv, .jsonl, .commands.json)", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
