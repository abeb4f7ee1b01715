"""Calibration text for DP's plan: one source against sources mixed, judged on every held-out source.

A loss table measured on one text source rewards what that source rewards; a plan can then win on
its calibration text and lose on text it never saw. This benchmark builds DP's default table
(estimator, objective and criterion as ``gap table``) on each calibration configuration (a source
or a comma-separated mix of sources, and a window count: ``--configs``), plans at each budget with
the default compensation counted, prunes as a checkpoint stores it, and measures the pruned model
window by window on the **selection** part of every held-out source (never the report part: this
evidence chooses a default, so it may not be reported as a result).

It prints, per budget, each configuration's perplexity and KL to dense on every source and on the
mean of sources, and the paired bootstrap ratio of each configuration against the first
(``gap_engine.evaluate.intervals``: ``first / configuration``, above 1 the configuration is better)
with its 95% interval and verdict (met, tie or loss).

Per-window numbers go into ``<name>.jsonl`` as they are measured, so a killed run continues where
it stopped (same settings; ``--fresh`` starts over); ``<name>.md`` is regenerated whole from it,
its first line the command that regenerates it with every setting spelled out.

    python bench/bench_calibration.py --name calibration
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quality import read_records
from quality_report import SELECTION, set_name, split_list
from report import RESULTS, machine_line, write_report

from gap_engine.core.config import (
    CLI_TABLE,
    DEFAULT_COMPENSATION,
    DEFAULT_CRITERION,
    DEFAULT_MAX_RATE,
    DEFAULT_SAVE_DTYPE,
    HELDOUT_TEXT_NAMES,
)
from gap_engine.evaluate.intervals import Interval, perplexity_ratio, ratio_of_means

log = logging.getLogger("bench_calibration")
SCRIPT = "bench/bench_calibration.py"
# Today's default calibration first (every ratio is against it), then the two built-in sources mixed
# at the default window count and at twice it, and wiki-sample alone at twice it (what the mix adds
# beyond the window count).
DEFAULT_CONFIGS = "wiki-sample:16,wiki-sample+news-sample:16,wiki-sample+news-sample:32,wiki-sample:32"

# Every option that changes a measured number or what the report holds, spelled out in the command
# at the top of the report.
SETTINGS = (
    "model",
    "configs",
    "seq_len",
    "estimator",
    "objective",
    "criterion",
    "rates",
    "compensation",
    "budgets",
    "eval_data",
    "selection_windows",
    "eval_seq_len",
    "window_seed",
    "resamples",
    "bootstrap_seed",
    "name",
)
# What every measured row depends on besides its own configuration (a row records its sources and
# window count): a results file measured with other values of these is not resumed, and a run with
# more configurations measures only the new ones.
MEASUREMENT = tuple(key for key in SETTINGS[: SETTINGS.index("resamples")] if key != "configs")


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``tests/bench`` runs it on the command a result file records)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="calibration configurations, comma-separated, each SOURCE[+SOURCE...]:WINDOWS (+ joins the sources a table "
        "mixes), then :obsN to prune by OBS on N windows, :fitN to fit the compensation on N windows, :capR to plan with no "
        "rate above R, :ucbK to plan on every cell's estimate plus K standard errors over the calibration windows and :norm to "
        "fit the compensation through the norms after the projections (Gemma 3); every "
        "ratio is against the first",
    )
    p.add_argument("--seq-len", type=int, default=CLI_TABLE.windows.seq_len, help="tokens per calibration window")
    p.add_argument("--estimator", default=CLI_TABLE.estimator)
    p.add_argument("--objective", default=CLI_TABLE.objective)
    p.add_argument("--criterion", default=DEFAULT_CRITERION, help="the table's criterion (DP prunes by it)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in CLI_TABLE.rate_grid), help="the table's rate grid")
    p.add_argument("--compensation", default=DEFAULT_COMPENSATION, help="what the plan's kept units get (its biases paid from the budget)")
    p.add_argument("--budgets", default="0.2,0.4")
    p.add_argument("--eval-data", default=",".join(HELDOUT_TEXT_NAMES), help="held-out sources, comma-separated")
    p.add_argument("--selection-windows", type=int, default=16, help="selection windows per held-out source")
    p.add_argument("--eval-seq-len", type=int, default=256, help="tokens per held-out window")
    p.add_argument("--window-seed", type=int, default=0, help="which held-out windows are drawn")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--eval-batch-size", type=int, default=1, help="windows per forward pass (memory only)")
    p.add_argument("--name", default="calibration", help="files bench/results/<name>.md and <name>.jsonl")
    p.add_argument("--fresh", action="store_true", help="discard <name>.jsonl and measure everything again")
    return p


class Config(NamedTuple):
    """One configuration: the calibration text as ``--data`` spells it, its windows, OBS's windows (None: the
    table's criterion prunes), the highest rate DP may give a component (None: the planner's default), the
    windows the compensation is fitted on (None: the table's), how many standard errors DP adds to every cell
    (None: it plans on the cells as they are) and how the compensation weighs its tokens (None: alike; "output-norm":
    through the norms after the projections, ``CompensationSettings.weighting``)."""

    data: str
    samples: int
    obs: int | None = None
    cap: float | None = None
    fit: int | None = None
    ucb: float | None = None
    weighting: str | None = None


def parse_configs(text: str) -> list[Config]:
    """Every configuration, in order: ``SOURCE[+SOURCE...]:WINDOWS`` prunes DP's plan by the table's criterion
    with ``--compensation``; ``:obsN`` after it, by OBS on N windows of the same text (no compensation: its
    update is one); ``:fitN``, the compensation fitted on N windows of the same text (the units still chosen on
    the table's); ``:capR``, DP plans with no component's rate above R (a constraint of the planner); ``:ucbK``,
    DP plans on every cell's estimate plus K of its standard errors over the calibration windows (the spread of
    each window's own estimate, ``estimate.estimated_increase_per_window``, over the square root of their count):
    a cell whose estimate rests on a few windows costs more; ``:norm``, the compensation fitted through the norms
    after o_proj and down_proj (``weighting="output-norm"``: Gemma 3's post-norms)."""
    configs: list[Config] = []
    for item in split_list(text):
        obs, cap, fit, ucb, weighting, spelled = None, None, None, None, None, item
        while True:
            head, _, last = item.rpartition(":")
            if weighting is None and last == "norm":
                weighting, item = "output-norm", head
            elif obs is None and last.startswith("obs") and last[3:].isdigit() and int(last[3:]) >= 1:
                obs, item = int(last[3:]), head
            elif fit is None and last.startswith("fit") and last[3:].isdigit() and int(last[3:]) >= 1:
                fit, item = int(last[3:]), head
            elif cap is None and last.startswith("cap") and _rate(last[3:]) is not None:
                cap, item = _rate(last[3:]), head
            elif ucb is None and last.startswith("ucb") and _count(last[3:]) is not None:
                ucb, item = _count(last[3:]), head
            else:
                break
        sources, _, count = item.rpartition(":")
        if not sources or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"--configs: {spelled!r} is not SOURCE[+SOURCE...]:WINDOWS[:obsN][:fitN][:capR][:ucbK][:norm] (R a rate in (0, 1), K >= 0)"
            )
        if obs is not None and fit is not None:
            raise ValueError(f"--configs: {spelled!r} names both :obsN and :fitN; OBS's update is its own compensation")
        if obs is not None and weighting is not None:
            raise ValueError(f"--configs: {spelled!r} names both :obsN and :norm; OBS's update is its own compensation")
        configs.append(Config(sources.replace("+", ","), int(count), obs, cap, fit, ucb, weighting))
    if len(configs) < 2:
        raise ValueError("--configs needs at least two configurations: every ratio is against the first")
    return configs


def _rate(text: str) -> float | None:
    """``text`` as a rate strictly between 0 and 1, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 < value < 1.0 else None


def _count(text: str) -> float | None:
    """``text`` as a finite number of standard errors, at least 0, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def config_label(config: Config, seq_len: int) -> str:
    step = "" if config.obs is None else f"; OBS on {config.obs} x {seq_len}"
    step += "" if config.fit is None else f"; compensation fitted on {config.fit} x {seq_len}"
    cap = "" if config.cap is None else f"; rates at most {config.cap:g}"
    cap += "" if config.ucb is None else f"; cells + {config.ucb:g} standard errors"
    cap += "" if config.weighting is None else f"; compensation weighted by {config.weighting}"
    return f"{config.data.replace(',', ' + ')}, {config.samples} x {seq_len}{step}{cap}"


def command_argv(args: argparse.Namespace) -> list[str]:
    """The argv that regenerates the report whole: every setting spelled out."""
    return [part for key in SETTINGS for part in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


# ---- measuring ---------------------------------------------------------------------------------
def measure(args: argparse.Namespace, path: Path) -> list[dict[str, Any]]:
    """Every record of ``path`` once each configuration and budget is measured (resuming what is there)."""
    import torch

    from gap_engine.core.config import WindowSpec
    from gap_engine.core.progress import Hooks
    from gap_engine.data.windows import calibration_windows, heldout_windows
    from gap_engine.evaluate.window_metrics import dense_windows, head_weight, window_numbers
    from gap_engine.model.loading import load_model
    from gap_engine.model.storage import parse_dtype
    from gap_engine.pipeline.stages import loss_table, pruned_as_saved, pruned_by
    from gap_engine.plan.allocators import plan_from_table
    from gap_engine.plan.problem import Constraints
    from gap_engine.prune.compensations import CompensationSettings
    from gap_engine.prune.importance import compute_importance
    from gap_engine.tables.artefact import TableSpec, isotonic_smooth, parse_rate_grid
    from gap_engine.tables.estimate import estimated_increase_per_window

    wanted = {key: str(getattr(args, key)) for key in MEASUREMENT}
    records = [] if args.fresh or not path.exists() else read_records(path)
    found = next((r["settings"] for r in records if r.get("kind") == "settings"), None)
    differ = [k for k in MEASUREMENT if found is not None and found.get(k) != wanted[k]]
    if differ:
        raise SystemExit(f"{path} was measured with other settings ({', '.join(differ)}): use --fresh, or another --name")

    def append(record: dict[str, Any]) -> None:
        with path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        records.append(record)

    if not records:
        RESULTS.mkdir(exist_ok=True)
        path.write_text("")
        append({"kind": "settings", "settings": wanted})

    dense = load_model(args.model)
    sets = {
        set_name(SELECTION, source): heldout_windows(
            dense.tokenizer,
            WindowSpec(data=source, n_samples=args.selection_windows, seq_len=args.eval_seq_len, seed=args.window_seed),
            SELECTION,
        )
        for source in split_list(args.eval_data)
    }
    if not any(r.get("kind") == "dense" for r in records):
        # Every pruned model is measured as a checkpoint stores it, so the dense side of the KL is
        # computed under the dense head rounded to the storage dtype.
        stored_head = head_weight(dense).detach().to(parse_dtype(DEFAULT_SAVE_DTYPE)).to(torch.float32)
        numbers = {name: dense_windows(dense, w, stored_head, args.eval_batch_size).nll.tolist() for name, w in sets.items()}
        append({"kind": "dense", "windows": {name: {"nll": nll} for name, nll in numbers.items()}})
    done = {row_key(r) for r in records if r.get("kind") == "row"}
    for config in parse_configs(args.configs):
        data, count, obs, cap, fit, ucb, weighting = config
        budgets = [round(float(b), 4) for b in split_list(args.budgets)]
        if all((*config, budget) in done for budget in budgets):
            continue
        calib = WindowSpec(data=data, n_samples=count, seq_len=args.seq_len, batch_size=8)
        spec = TableSpec(
            windows=calib,
            criterion=args.criterion,
            rate_grid=parse_rate_grid(args.rates),
            estimator=args.estimator,
            objective=args.objective,
        )
        started = time.perf_counter()
        table = loss_table(dense, spec, hooks=Hooks(progress=lambda d, t, eta: None))
        table_s = time.perf_counter() - started
        log.info("%s: table ready in %.0f s", config_label(config, args.seq_len), table_s)
        scores = compute_importance(dense, calibration_windows(dense.tokenizer, calib), args.criterion, calib.batch_size)
        if ucb is not None:  # every cell made dearer by K standard errors of its estimate over the calibration windows
            ids = calibration_windows(dense.tokenizer, calib)
            per_window = estimated_increase_per_window(dense, spec, ids, scores, table.components)
            delta = table.delta + ucb * per_window.std(0, ddof=1) / math.sqrt(per_window.shape[0])
            table = dataclasses.replace(table, delta=delta, smoothed=isotonic_smooth(delta), key=f"{table.key}+ucb{ucb:g}")
        for budget in budgets:
            if (*config, budget) in done:
                continue
            started = time.perf_counter()
            compensation = args.compensation if obs is None else "none"  # OBS's update is its compensation
            limits = Constraints() if cap is None else Constraints(max_rate=cap)
            plan = plan_from_table(dense, table, budget, "dp", limits, scores=scores, compensation=compensation)
            if obs is not None:
                plan = pruned_by(plan, "obs")
            pruned, result = pruned_as_saved(
                dense,
                plan,
                calib,
                scores=scores,
                # fitted on the table's own windows unless :fitN says otherwise, not on a family's default floor: a
                # configuration spells its calibration whole, so its file reads the same whatever the default becomes
                compensation=CompensationSettings(
                    mode=compensation,
                    samples=fit if fit is not None or compensation == "none" else count,
                    weighting=weighting or "tokens",
                ),
                obs_samples=obs,
            )
            numbers = window_numbers(pruned, dense, sets, args.eval_batch_size)
            append(
                {
                    "kind": "row",
                    "data": data,
                    "samples": count,
                    **({} if obs is None else {"obs_samples": obs}),
                    **({} if cap is None else {"max_rate": cap}),
                    **({} if fit is None else {"fit_samples": fit}),
                    **({} if ucb is None else {"ucb": ucb}),
                    **({} if weighting is None else {"weighting": weighting}),
                    "budget": budget,
                    "table_key": table.key,
                    "table_s": round(table_s, 1),
                    "attention_rates": [round(r, 4) for r in plan.attention_rates],
                    "mlp_rates": [round(r, 4) for r in plan.mlp_rates],
                    "net_removed_fraction": (result.params_before - result.params_after) / int(plan.params["dense_prunable"]),
                    "windows": {name: {"nll": n.nll, "kl": n.kl} for name, n in numbers.items()},
                    "prune_eval_s": round(time.perf_counter() - started, 1),
                }
            )
            log.info("%s at %g: measured", config_label(config, args.seq_len), budget)
            del pruned
    return records


def row_key(row: dict[str, Any]) -> tuple[str, int, int | None, float | None, int | None, float | None, str | None, float]:
    """What a measured row is of: its configuration (calibration text, window count, OBS's window count, rate cap,
    the compensation's window count, the standard errors added to every cell, its weighting) and budget."""
    return (
        row["data"],
        int(row["samples"]),
        row.get("obs_samples"),
        row.get("max_rate"),
        row.get("fit_samples"),
        row.get("ucb"),
        row.get("weighting"),
        round(float(row["budget"]), 4),
    )


def row_place(row: dict[str, Any], configs: Sequence[Config]) -> tuple[int, float]:
    """(index of the row's configuration in ``configs``, or -1 where it is not one of them; its budget)."""
    *config, budget = row_key(row)
    found = Config(*config)
    return (configs.index(found) if found in configs else -1), budget


# ---- the report --------------------------------------------------------------------------------
def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _ppl(nll: Sequence[Sequence[float]]) -> float:
    """exp of the mean over sources of each source's mean NLL: one source's perplexity, or the
    geometric mean of the sources' perplexities."""
    return math.exp(_mean([_mean(w) for w in nll]))


def _ratio(interval: Interval) -> str:
    return f"{interval.text(3)} {interval.verdict()}"


def report_lines(
    args: argparse.Namespace, records: Sequence[dict[str, Any]], load_start: Sequence[float], started: float, resumed: int = 0
) -> list[str]:
    """The report's lines (``resumed``: rows read back from the results file rather than measured by this run)."""
    configs = parse_configs(args.configs)
    sources = split_list(args.eval_data)
    budgets = [round(float(b), 4) for b in split_list(args.budgets)]
    dense = next(r for r in records if r.get("kind") == "dense")
    rows = {(index, budget): r for r in records if r.get("kind") == "row" for index, budget in [row_place(r, configs)] if index >= 0}
    labels = [config_label(c, args.seq_len) for c in configs]

    def series(row: dict[str, Any], metric: str, names: Sequence[str]) -> list[list[float]]:
        return [row["windows"][set_name(SELECTION, s)][metric] for s in names]

    def interval(base: dict[str, Any], other: dict[str, Any], metric: str, names: Sequence[str]) -> Interval:
        compare = ratio_of_means if metric == "kl" else perplexity_ratio
        return compare(series(base, metric, names), series(other, metric, names), resamples=args.resamples, seed=args.bootstrap_seed)

    command = shlex.join(["python", SCRIPT, *command_argv(args)])
    dense_ppl = {s: _ppl([dense["windows"][set_name(SELECTION, s)]["nll"]]) for s in sources}
    obs_step = any(c.obs is not None for c in configs)
    capped = any(c.cap is not None for c in configs)
    hedged = any(c.ucb is not None for c in configs)
    fitted = any(c.fit is not None for c in configs)
    subject = "the table's text and windows, and OBS's windows" if obs_step else "one source or several"
    subject += ", and the compensation's windows" if fitted else ""
    subject += ", and a cap on every rate" if capped else ""
    subject += ", and cells made dearer by their standard errors" if hedged else ""
    lines = [
        f"# Calibration text for DP's plan on {args.model}: {subject}, judged on the selection part of every held-out source",
        "",
        f"`{command}`",
        "",
        f"The command above regenerates this file whole; per-window numbers are in `{args.name}.jsonl`.",
        "",
        machine_line(load_start, started)
        + (f" {resumed} of the {len(rows)} rows were measured by an earlier run of the same settings and read back." if resumed else ""),
        "",
        "## Settings",
        "",
        f"- DP's plan ({args.estimator} table, objective {args.objective}, criterion {args.criterion}, rates {args.rates}; "
        f"compensation {args.compensation}, its biases paid from the budget), calibrated on each configuration: "
        + "; ".join(f"({chr(97 + i)}) {label}" for i, label in enumerate(labels))
        + ". A mixed calibration divides its windows among its sources in the order named, each drawn from its own calibration part."
        + (
            " Where a configuration names OBS, DP's plan (counted for no biases) is pruned by OBS instead (SlimGPT's selection "
            "and update, block by block) on that many windows of the same text (the first of them the table's), with no other compensation."
            if obs_step
            else ""
        )
        + (
            " Where a configuration names the compensation's windows, DP's plan is pruned as the table's windows choose "
            "(its criterion scored on them), and only the compensation's fit reads that many windows of the same text "
            "(the first of them the table's)."
            if fitted
            else ""
        )
        + (
            " Where a configuration gives a cap, DP plans with no unlocked component's rate above it (`--max-rate`);"
            f" the others with the planner's default ({DEFAULT_MAX_RATE:g})."
            if capped
            else ""
        )
        + (
            " Where a configuration adds K standard errors, DP plans on every cell's estimate plus K times its standard error "
            "over the calibration windows: each window's own estimate of the cell (the same gradient pass, its gradients "
            "kept window by window), their standard deviation over the square root of the window count; the rows are then "
            "smoothed as every table is (non-decreasing in the rate)."
            if hedged
            else ""
        ),
        f"- Measured on the **selection** part of every held-out source ({', '.join(sources)}): {args.selection_windows} windows x "
        f"{args.eval_seq_len} tokens each, window seed {args.window_seed}; the report part is never read. These numbers choose "
        "a default, so none of them is a reported result.",
        f"- Pruned models are measured as a checkpoint stores them ({DEFAULT_SAVE_DTYPE}). Perplexity on the mean of sources is "
        "the geometric mean of the sources' perplexities; KL is KL(dense || pruned) per token, averaged over windows, then over sources.",
        f"- Ratios are (a) / configuration (above 1: the configuration is better than (a)), with a paired bootstrap 95% interval over "
        f"the windows ({args.resamples} resamples, seed {args.bootstrap_seed}, windows resampled within each source): met when the "
        "interval lies above 1, loss when below, tie when it holds 1.",
        "- Dense perplexity on the selection windows: " + ", ".join(f"{s} {dense_ppl[s]:.2f}" for s in sources) + ".",
        "",
        "## Against (a), on the mean of sources",
        "",
        "| budget | configuration | KL ratio (a) / it [95%] | perplexity ratio (a) / it [95%] |",
        "|---:|---|---|---|",
    ]

    def against_a() -> Iterator[tuple[float, int, dict[str, Any] | None, dict[str, Any] | None]]:
        """(budget, configuration, (a)'s row, its row) for every configuration after (a), rows None where not measured."""
        for budget in budgets:
            for index in range(1, len(configs)):
                yield budget, index, rows.get((0, budget)), rows.get((index, budget))

    for budget, index, base, row in against_a():
        if base is None or row is None:
            lines.append(f"| {budget:g} | ({chr(97 + index)}) {labels[index]} | not measured | not measured |")
            continue
        kl, ppl = interval(base, row, "kl", sources), interval(base, row, "nll", sources)
        lines.append(f"| {budget:g} | ({chr(97 + index)}) {labels[index]} | {_ratio(kl)} | {_ratio(ppl)} |")
    lines += [
        "",
        "## Against (a), per source",
        "",
        "| budget | configuration | source | KL ratio [95%] | perplexity ratio [95%] |",
        "|---:|---|---|---|---|",
    ]
    for budget, index, base, row in against_a():
        if base is None or row is None:
            continue
        for source in sources:
            kl, ppl = interval(base, row, "kl", [source]), interval(base, row, "nll", [source])
            lines.append(f"| {budget:g} | ({chr(97 + index)}) | {source} | {_ratio(kl)} | {_ratio(ppl)} |")
    header = " | ".join(f"{s} ppl" for s in sources) + " | mean ppl | " + " | ".join(f"{s} KL" for s in sources) + " | mean KL"
    lines += ["", "## Every configuration", "", f"| budget | configuration | {header} |", "|---:|---|" + "---:|" * (2 * len(sources) + 2)]
    for budget in budgets:
        for index, label in enumerate(labels):
            row = rows.get((index, budget))
            if row is None:
                continue
            ppl = [_ppl([row["windows"][set_name(SELECTION, s)]["nll"]]) for s in sources] + [_ppl(series(row, "nll", sources))]
            kl = [_mean(w) for w in series(row, "kl", sources)]
            cells = [f"{p:.2f}" for p in ppl] + [f"{k:.4f}" for k in [*kl, _mean(kl)]]
            lines.append(f"| {budget:g} | ({chr(97 + index)}) {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Plans",
        "",
        "| budget | configuration | net removed | attention rates | MLP rates | table key | table s |",
        "|---:|---|---:|---|---|---|---:|",
    ]
    for budget in budgets:
        for index in range(len(configs)):
            row = rows.get((index, budget))
            if row is None:
                continue
            att = " ".join(f"{r:.2f}" for r in row["attention_rates"])
            mlp = " ".join(f"{r:.2f}" for r in row["mlp_rates"])
            lines.append(
                f"| {budget:g} | ({chr(97 + index)}) | {row['net_removed_fraction']:.3f} | {att} | {mlp} | `{row['table_key']}` | {row['table_s']:.0f} |"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        parse_configs(args.configs)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    load_start, started = os.getloadavg(), time.perf_counter()
    path = RESULTS / f"{args.name}.jsonl"
    resumed = 0 if args.fresh or not path.exists() else sum(1 for r in read_records(path) if r.get("kind") == "row")
    records = measure(args, path)
    lines = report_lines(args, records, load_start, started, resumed)
    write_report(args.name, lines, SCRIPT, command_argv(args), files=[path.name])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
