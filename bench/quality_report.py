"""The markdown of bench_quality.py: targets with paired bootstrap intervals, each method on the report
part (its default and its best on selection), the choices made on the selection part, every row.

A pure function of the results file's records (no model, no torch), so its selection and verdict
logic is tested on hand-made rows (``tests/bench/test_bench_quality.py``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gap_engine.evaluate.intervals import Interval, mean_interval, perplexity_interval, perplexity_ratio, ratio_of_means

REPORT = "report"
SELECTION = "selection"
TASK = "gap_wiki_next"
MIN_TASK_EXAMPLES = 500  # a task claim rests on at least this many examples
BASELINES = ("uniform", "flap", "slimgpt", "owl", "evo")
# How close to dense DP's default plan is held: (budget, the most its perplexity may be over dense's, where: on the
# mean of sources or on every source).
DENSE_TARGETS = ((0.2, 1.6, "the mean of sources"), (0.4, 4.0, "every source"))


def split_list(text: str) -> list[str]:
    return [part.strip() for part in str(text).split(",") if part.strip()]


def budgets_of(args: argparse.Namespace) -> list[float]:
    return [round(float(b), 4) for b in split_list(args.budgets)]


def sources_of(args: argparse.Namespace) -> list[str]:
    return split_list(args.eval_data)


def set_name(split: str, source: str) -> str:
    return f"{split}/{source}"


def row_key(row: dict[str, Any]) -> tuple[float, str, str]:
    return (round(float(row["budget"]), 4), row["allocator"], row["compensation"])


# ---- choices on the selection part ------------------------------------------------------------------
def mean_kl(row: dict[str, Any], split: str, sources: Sequence[str]) -> float:
    """Mean over the sources of each source's mean KL over its windows of ``split``."""
    per_source = [sum(w) / len(w) for w in (row["windows"][set_name(split, s)]["kl"] for s in sources)]
    return sum(per_source) / len(per_source)


@dataclass(frozen=True)
class Group:
    """One allocator at one budget: its menu and what was measured of it."""

    budget: float
    allocator: str
    menu: tuple[str, ...]  # the compensations it takes, in menu order
    default: str  # its shipped compensation
    criterion: str = ""  # what its plan prunes by (``plan.step``: dp's is its model family's step)


def best_measured(group: Group, rows: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any] | None:
    """The group's measured row with the lowest mean selection KL over ``sources`` (the first in
    menu order on a tie); None when none is measured."""
    found = {row_key(r)[2]: r for r in rows if row_key(r)[:2] == (group.budget, group.allocator)}
    measured = [found[c] for c in group.menu if c in found]
    return min(measured, key=lambda r: mean_kl(r, SELECTION, sources)) if measured else None


def best_on_selection(group: Group, rows: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[str, Any] | None:
    """The group's row with the lowest mean selection KL over ``sources`` (the first in menu order
    on a tie); None until every compensation of its menu is measured."""
    found = {row_key(r)[2] for r in rows if row_key(r)[:2] == (group.budget, group.allocator)}
    if any(c not in found for c in group.menu):
        return None
    return best_measured(group, rows, sources)


def on_report(row: dict[str, Any], sources: Sequence[str]) -> bool:
    """Whether the row was measured on the report windows of every source."""
    return all(set_name(REPORT, s) in row["windows"] for s in sources)


class Bootstrap:
    """The report part's per-window numbers of rows, and intervals over them with one seed."""

    def __init__(self, sources: Sequence[str], resamples: int, seed: int):
        self.sources, self.resamples, self.seed = list(sources), resamples, seed

    def windows(self, row: dict[str, Any], metric: str, sources: Sequence[str], split: str = REPORT) -> list[list[float]]:
        return [row["windows"][set_name(split, s)][metric] for s in sources]

    def margin(
        self, baseline: dict[str, Any], method: dict[str, Any], metric: str, sources: Sequence[str], split: str = REPORT
    ) -> Interval:
        """``baseline / method`` on ``sources`` (above 1: the method is better): KL or perplexity."""
        compare = ratio_of_means if metric == "kl" else perplexity_ratio
        return compare(
            self.windows(baseline, metric, sources, split),
            self.windows(method, metric, sources, split),
            resamples=self.resamples,
            seed=self.seed,
        )

    def value(self, row: dict[str, Any], metric: str, sources: Sequence[str]) -> Interval:
        """One row's mean KL, or perplexity (from its NLL), on ``sources``, with its interval."""
        own = mean_interval if metric == "kl" else perplexity_interval
        return own(self.windows(row, "kl" if metric == "kl" else "nll", sources), resamples=self.resamples, seed=self.seed)


def _cell(interval: Interval, digits: int = 3, verdict: bool = False) -> str:
    text = f"{interval.estimate:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"
    return f"{text} {interval.verdict()}" if verdict else text


def _digits(value: float) -> int:
    return 1 if value >= 100 else 2 if value >= 10 else 3


def _ppl_cell(interval: Interval) -> str:
    return _cell(interval, _digits(interval.estimate))


def _dense_ppl(dense: dict[str, Any] | None, split: str, source: str) -> float | None:
    if dense is None:
        return None
    nll = dense["windows"][set_name(split, source)]["nll"]
    return math.exp(sum(nll) / len(nll))


def chosen_rows(groups: Sequence[Group], rows: Sequence[dict[str, Any]], sources: Sequence[str]) -> dict[tuple[float, str], dict[str, Any]]:
    """(budget, allocator) -> {"best": row chosen on selection, "default": row at the shipped default}, complete groups only."""
    by_key = {row_key(r): r for r in rows}
    out = {}
    for group in groups:
        best = best_on_selection(group, rows, sources)
        default = by_key.get((group.budget, group.allocator, group.default))
        if best is not None and default is not None and on_report(best, sources) and on_report(default, sources):
            out[(group.budget, group.allocator)] = {"best": best, "default": default}
    return out


def dp_variants(groups: Sequence[Group]) -> list[str]:
    """The DP rows whose margins are reported: ``dp`` and DP's plan pruned by another criterion (``dp:obs``)."""
    return [a for a in dict.fromkeys(g.allocator for g in groups) if a.partition(":")[0] == "dp"]


def dp_label(variant: str) -> str:
    allocator, _, criterion = variant.partition(":")
    return "DP" if not criterion else f"DP pruned by {criterion}"


def target_lines(
    groups: Sequence[Group], rows: Sequence[dict[str, Any]], sources: Sequence[str], boot: Bootstrap
) -> tuple[list[str], dict[str, dict[str, int]]]:
    """The targets' tables (each DP variant at its default and at its best on selection, against
    every baseline at its best) and, per table, how many margins were met, tied and lost."""
    chosen = chosen_rows(groups, rows, sources)
    budgets = sorted({g.budget for g in groups})
    baselines = [a for a in dict.fromkeys(g.allocator for g in groups) if a in BASELINES]
    counts: dict[str, dict[str, int]] = {}
    lines: list[str] = []
    columns = [*sources, "mean"]
    for variant in dp_variants(groups):
        for which, how in (("default", "at its default compensation"), ("best", "at its best compensation (chosen on selection)")):
            title = f"{dp_label(variant)} {how}"
            tally = counts.setdefault(
                f"{dp_label(variant)} at its {'default' if which == 'default' else 'best on selection'}", {"met": 0, "tie": 0, "loss": 0}
            )
            lines += [
                f"### {title} against every baseline at its best",
                "",
                "Ratio = baseline / DP on the report windows (above 1: DP better), 95% interval; KL: ratio of mean KL to dense; "
                "perplexity: exp of the mean NLL difference (on the mean of sources: of the geometric means).",
                "",
                "| budget | DP | baseline (best) | "
                + " | ".join(f"KL {c}" for c in columns)
                + " | "
                + " | ".join(f"ppl {c}" for c in columns)
                + " |",
                "|---:|---|---|" + "---|" * (2 * len(columns)),
            ]
            for budget in budgets:
                dp = chosen.get((budget, variant))
                for name in baselines:
                    other = chosen.get((budget, name))
                    if dp is None or other is None:
                        continue
                    cells = []
                    for metric in ("kl", "nll"):
                        for column in columns:
                            interval = boot.margin(other["best"], dp[which], metric, sources if column == "mean" else [column])
                            tally[interval.verdict()] += 1
                            cells.append(_cell(interval, verdict=True))
                    lines.append(
                        f"| {budget:.0%} | {dp[which]['compensation']} | {name} ({other['best']['compensation']}) | "
                        + " | ".join(cells)
                        + " |"
                    )
            lines += [
                "",
                f"{title}: {tally['met']} margins met, {tally['tie']} ties, {tally['loss']} losses "
                f"(of {sum(tally.values())}: every budget, baseline, metric, source and the mean of sources).",
                "",
            ]
    return lines, counts


def _within(interval: Interval, limit: float) -> str:
    """Whether a ratio to dense is within ``limit``: its whole interval below it, tie where the interval holds it."""
    return "met" if interval.high < limit else "missed" if interval.low > limit else "tie"


def dense_lines(
    groups: Sequence[Group], rows: Sequence[dict[str, Any]], sources: Sequence[str], dense: dict[str, Any] | None, boot: Bootstrap
) -> list[str]:
    """Each DP variant's default plan against the dense model on the same report windows: its perplexity over dense's,
    per source and on the mean of sources, with the paired interval (the windows resampled with the dense model's
    numbers beside them, as every other margin), and the verdict on ``DENSE_TARGETS``."""
    if dense is None:
        return []
    chosen = chosen_rows(groups, rows, sources)
    dense_row = {"windows": dense["windows"]}
    columns = [*sources, "mean"]
    lines = [
        "Ratio = DP's perplexity / dense perplexity on the same report windows (exp of the mean NLL difference; on the "
        "mean of sources, of the geometric means), 95% paired bootstrap interval. A bound is met when the whole interval "
        "lies below it, a tie when the interval holds it.",
        "",
        "| budget | DP | " + " | ".join(f"ppl / dense {c}" for c in columns) + " |",
        "|---:|---|" + "---|" * len(columns),
    ]
    ratios: dict[tuple[float, str], dict[str, Interval]] = {}
    for budget in sorted({g.budget for g in groups}):
        for variant in dp_variants(groups):
            dp = chosen.get((budget, variant))
            if dp is None:
                continue
            found = {c: boot.margin(dp["default"], dense_row, "nll", sources if c == "mean" else [c]) for c in columns}
            ratios[(budget, variant)] = found
            lines.append(
                f"| {budget:.0%} | {dp_label(variant)} ({dp['default']['compensation']}) | "
                + " | ".join(_cell(found[c], 2) for c in columns)
                + " |"
            )
    lines.append("")
    for budget, limit, where in DENSE_TARGETS:
        for variant in dp_variants(groups):
            found = ratios.get((budget, variant))
            if found is None:
                continue
            judged = ["mean"] if where == "the mean of sources" else list(sources)
            verdicts = {c: _within(found[c], limit) for c in judged}
            overall = "missed" if "missed" in verdicts.values() else "tie" if "tie" in verdicts.values() else "met"
            detail = ", ".join(f"{c} {found[c].estimate:.2f}x [{found[c].low:.2f}, {found[c].high:.2f}]" for c in judged)
            lines.append(
                f"- {dp_label(variant)} at its default, {budget:.0%}, within {limit:g}x of dense on {where}: **{overall}** ({detail})."
            )
    return lines + [""]


def summary_lines(groups: Sequence[Group], rows: Sequence[dict[str, Any]], sources: Sequence[str], boot: Bootstrap) -> list[str]:
    """One line per budget and DP variant: the verdicts on the mean of sources against each baseline."""
    chosen = chosen_rows(groups, rows, sources)
    baselines = [a for a in dict.fromkeys(g.allocator for g in groups) if a in BASELINES]
    lines = []
    for budget in sorted({g.budget for g in groups}):
        for variant in dp_variants(groups):
            dp = chosen.get((budget, variant))
            if dp is None:
                continue
            for which in ("default", "best"):
                parts = []
                for name in baselines:
                    other = chosen.get((budget, name))
                    if other is None:
                        continue
                    kl = boot.margin(other["best"], dp[which], "kl", sources)
                    ppl = boot.margin(other["best"], dp[which], "nll", sources)
                    parts.append(f"{name}: KL {kl.verdict()} ({kl.estimate:.2f}), perplexity {ppl.verdict()} ({ppl.estimate:.2f})")
                lines.append(
                    f"- {budget:.0%}, {dp_label(variant)} {which} ({dp[which]['compensation']}) on the mean of sources: "
                    + "; ".join(parts)
                    + "."
                )
    return lines


def method_lines(
    groups: Sequence[Group],
    rows: Sequence[dict[str, Any]],
    sources: Sequence[str],
    boot: Bootstrap,
    tasks: Sequence[dict[str, Any]],
) -> list[str]:
    """Every method at its default and at its best (chosen on selection), on the report part."""
    chosen = chosen_rows(groups, rows, sources)
    scores = {(t["budget"], t["allocator"], t["compensation"]): t for t in tasks if t.get("n", 0) >= MIN_TASK_EXAMPLES}
    columns = [*sources, "mean"]
    with_task = bool(scores)
    lines = [
        "| budget | allocator | compensation | removed net of biases | "
        + " | ".join(f"ppl {c}" for c in columns)
        + " | "
        + " | ".join(f"KL {c}" for c in columns)
        + " | top-1 mean |"
        + (" task acc |" if with_task else ""),
        "|---:|---|---|---:|" + "---|" * (2 * len(columns)) + "---:|" + ("---:|" if with_task else ""),
    ]
    for group in groups:
        picked = chosen.get((group.budget, group.allocator))
        if picked is None:
            lines.append(f"| {group.budget:.0%} | {group.allocator} | not measured in full | | " + " | " * (2 * len(columns)) + " |")
            continue
        for row in dict.fromkeys([id(picked["default"]), id(picked["best"])]):
            r = picked["default"] if row == id(picked["default"]) else picked["best"]
            how = []
            if r is picked["default"]:
                how.append("default")
            if r is picked["best"]:
                how.append("best on selection")
            ppl = [_ppl_cell(boot.value(r, "ppl", sources if c == "mean" else [c])) for c in columns]
            kl = [_cell(boot.value(r, "kl", sources if c == "mean" else [c])) for c in columns]
            top1 = [sum(r["windows"][set_name(REPORT, s)]["top1"]) / len(r["windows"][set_name(REPORT, s)]["top1"]) for s in sources]
            task = scores.get(row_key(r))
            task_cell = (f" {_accuracy(task)} |" if task else " |") if with_task else ""
            lines.append(
                f"| {group.budget:.0%} | {group.allocator} | {r['compensation']} ({', '.join(how)}) | "
                f"{r.get('net_removed_fraction', r['removed_fraction']):.2%} | "
                + " | ".join(ppl)
                + " | "
                + " | ".join(kl)
                + f" | {sum(top1) / len(top1):.3f} |"
                + task_cell
            )
    return lines


def selection_lines(groups: Sequence[Group], rows: Sequence[dict[str, Any]], sources: Sequence[str]) -> list[str]:
    """Every row's mean KL on the selection part: what chose each method's best compensation."""
    lines = [
        "| budget | allocator | compensation | " + " | ".join(f"KL {s}" for s in sources) + " | KL mean | chosen |",
        "|---:|---|---|" + "---:|" * len(sources) + "---:|---|",
    ]
    by_key = {row_key(r): r for r in rows}
    for group in groups:
        best = best_on_selection(group, rows, sources)
        for compensation in group.menu:
            row = by_key.get((group.budget, group.allocator, compensation))
            if row is None:
                continue
            per_source = [mean_kl(row, SELECTION, [s]) for s in sources]
            mark = "best" if best is row else ""
            lines.append(
                f"| {group.budget:.0%} | {group.allocator} | {compensation} | "
                + " | ".join(f"{x:.4f}" for x in per_source)
                + f" | {mean_kl(row, SELECTION, sources):.4f} | {mark} |"
            )
    return lines


def step_lines(groups: Sequence[Group], rows: Sequence[dict[str, Any]], sources: Sequence[str], boot: Bootstrap) -> list[str]:
    """DP's plan pruned by its default step at its default compensation against the same plan
    pruned by another criterion (``dp:wanda``, ``dp:obs``) at each of its compensations, on the
    *selection* windows, with intervals: the evidence a default step is chosen on."""
    variants = [v for v in dp_variants(groups) if v != "dp"]
    plain = {g.budget: g for g in groups if g.allocator == "dp"}
    if not variants or not plain:
        return []
    by_key = {row_key(r): r for r in rows}
    lines = [
        "Ratio = DP at its default step and compensation / the other step (above 1: the other step is better), on the "
        "selection windows of every "
        "source (mean of sources), paired bootstrap within each source; `met` means the other step is better, `loss` that it is worse.",
        "",
        "| budget | DP (default) | other step | KL ratio (mean of sources) | perplexity ratio (mean of sources) |",
        "|---:|---|---|---|---|",
    ]
    for group in groups:
        if group.allocator not in variants or group.budget not in plain:
            continue
        base = by_key.get((group.budget, "dp", plain[group.budget].default))
        if base is None or not all(set_name(SELECTION, s) in base["windows"] for s in sources):
            continue
        for compensation in group.menu:
            row = by_key.get((group.budget, group.allocator, compensation))
            if row is None:
                continue
            kl = boot.margin(base, row, "kl", sources, SELECTION)
            ppl = boot.margin(base, row, "nll", sources, SELECTION)
            lines.append(
                f"| {group.budget:.0%} | {plain[group.budget].criterion}, {plain[group.budget].default} | "
                f"{dp_label(group.allocator)} ({compensation}) | "
                f"{_cell(kl, verdict=True)} | {_cell(ppl, verdict=True)} |"
            )
    return lines


def row_lines(rows: Sequence[dict[str, Any]], sources: Sequence[str], groups: Sequence[Group]) -> list[str]:
    """Every row of the menu measured on the report part: window means, parameters, times (pruning, the
    selection windows) and the load while it was pruned. A results file may hold rows of entries this
    command's menu leaves out (a longer menu resumed it): they are not this report's."""
    lines = [
        "| budget | allocator | compensation | removed | net of biases | params after | "
        + " | ".join(f"ppl {s}" for s in sources)
        + " | "
        + " | ".join(f"KL {s}" for s in sources)
        + " | prune s | eval s | load |",
        "|---:|---|---|---:|---:|---:|" + "---:|" * (2 * len(sources)) + "---:|---:|---|",
    ]
    keys = [(g.budget, g.allocator, c) for g in groups for c in g.menu]
    order = {key: i for i, key in enumerate(keys)}
    for r in sorted((r for r in rows if on_report(r, sources) and row_key(r) in order), key=lambda r: order[row_key(r)]):
        ppl = [math.exp(sum(w) / len(w)) for w in (r["windows"][set_name(REPORT, s)]["nll"] for s in sources)]
        kl = [mean_kl(r, REPORT, [s]) for s in sources]
        lines.append(
            f"| {r['budget']:.0%} | {r['allocator']} | {r['compensation']} | {r['removed_fraction']:.2%} | "
            f"{r.get('net_removed_fraction', r['removed_fraction']):.2%} | {r['params_after']:,} | "
            + " | ".join(f"{x:.{_digits(x)}f}" for x in ppl)
            + " | "
            + " | ".join(f"{x:.4f}" for x in kl)
            + f" | {r['prune_s']:.0f} | {r['eval_s']:.0f} | {r['load_start']:.1f}-{r['load_end']:.1f} |"
        )
    return lines


def settings_lines(args: Any, groups: Sequence[Group], sources: Sequence[str], dense: dict[str, Any] | None) -> list[str]:
    menus = {}
    for group in groups:
        menus.setdefault(group.allocator, (group.menu, group.default))
    menu_text = "; ".join(f"{a}: {', '.join(m)} (default {d})" for a, (m, d) in menus.items())
    if any(c.endswith(":norm") for group in groups for c in group.menu):
        menu_text += (
            " (NAME:norm: NAME fitted through the norms after o_proj and down_proj, each token, BOS included, by the inverse "
            "mean square of the projection's dense output on it; after OBS, its bias so)"
        )
    steps = {}
    for group in groups:
        steps.setdefault(group.allocator, group.criterion)
    step_text = ", ".join(f"{a} by {c}" for a, c in steps.items())
    obs_samples = getattr(args, "obs_samples", None) or args.samples
    fit_samples = getattr(args, "fit_samples", None) or args.samples
    dense_text = ", ".join(
        f"{s} {_dense_ppl(dense, REPORT, s):.2f} (selection {_dense_ppl(dense, SELECTION, s):.2f})" for s in sources if dense is not None
    )
    return [
        "## Settings",
        "",
        f"- Model {args.model}. Calibration: {args.samples} windows x {args.seq_len} tokens of {args.data} (the loss table's; "
        + (
            "compensation is fitted and FLAP's fluctuation and SlimGPT's Hessians are measured on them). "
            if obs_samples == args.samples == fit_samples
            else f"compensation is fitted and FLAP's fluctuation is measured on them; every plan pruned by OBS, SlimGPT's and "
            f"any other, reads {obs_samples} windows of the same text for its Hessians, and fits a bias there). "
            if fit_samples == args.samples
            else f"FLAP's fluctuation is measured on them; every compensation after a cut is fitted on {fit_samples} windows of "
            "the same text, the first of them these, and every plan pruned by OBS, SlimGPT's and any other, reads "
            f"{obs_samples} windows of it for its Hessians and fits a bias there). "
        )
        + "DP's table: estimator "
        f"{args.estimator}, objective {args.objective}, criterion {args.criterion}. The plans prune: {step_text} (a bare dp "
        "prunes by its model family's default step, `gap_engine.plan.step`; dp:CRITERION prunes DP's plan by that criterion; "
        "flap by FLAP's fluctuation metric, slimgpt by its greedy OBS).",
        f"- The same menu for every method, each compensation its criterion can take: {menu_text}. A plan is made once per "
        "allocator and budget; its compensations prune the same units. Every model is measured as a checkpoint stores it "
        "(weights rounded to bfloat16).",
        f"- Held-out text of {', '.join(sources)}, divided by document into a selection part and a report part that share no "
        f"document with each other or with calibration text: {args.selection_windows} selection and {args.report_windows} "
        f"report windows x {args.eval_seq_len} tokens per source (window seed {args.window_seed}). Each method's best "
        "compensation at each budget is the one with the lowest mean KL to dense over the sources on the *selection* "
        "windows; every number below is measured on the *report* windows, which chose nothing.",
        f"- Intervals: paired percentile bootstrap over the report windows, resampled within each source and jointly for the "
        f"two methods compared, {args.resamples} resamples, seed {args.bootstrap_seed}, 95%. A target is *met* when the "
        "interval of the ratio lies above 1, a *tie* when it contains 1, a *loss* when it lies below 1. One method's own "
        "mean KL and perplexity carry the same bootstrap's interval. The mean of sources: mean KL over sources; perplexity "
        "of the mean NLL (the geometric mean of the sources' perplexities).",
        f"- KL is KL(dense || pruned) per token; top-1 the share of positions where the pruned model's most likely next token "
        f"is the dense model's. Dense perplexity on the report windows: {dense_text}.",
        "- Budgets are fractions of the prunable parameters (attention and MLP projections). A plan whose prune adds biases "
        "(bias, bias+refit) pays for them from the budget, so every row ships at least the budget's net removal: `removed` "
        "is what the cut removes, `net of biases` what the shipped model lost (biases counted), `params after` the model's "
        "parameters. DP plans on the table's rate grid, so its removal can pass the budget by up to one grid step of one "
        "component; the other allocators are fitted to it within one unit. Load: the 1-minute load average at the start and end of "
        "the row.",
        "",
    ]


def _accuracy(task: dict[str, Any]) -> str:
    """Accuracy ± its standard error (lm-eval may report none)."""
    return f"{task['acc']:.3f}" + (f" ± {task['stderr']:.3f}" if task.get("stderr") is not None else "")


def task_lines(tasks: Sequence[dict[str, Any]]) -> list[str]:
    dense = next((t for t in tasks if t["allocator"] == "dense"), None)
    counted = [t for t in tasks if t.get("n", 0) >= MIN_TASK_EXAMPLES]
    if not counted:
        return [f"Task accuracy was not measured (a claim on it needs at least {MIN_TASK_EXAMPLES} examples of {TASK})."]
    dense_text = f" (dense {_accuracy(dense)})" if dense and dense.get("n", 0) >= MIN_TASK_EXAMPLES else ""
    return [
        f"Task accuracy: zero-shot `{TASK}` on {counted[0]['n']} examples (lm-eval acc ± its standard error){dense_text}, "
        "in the table above for each method's default and best."
    ]


def report_text(
    args: Any,
    command: str,
    machine: str,
    rows: Sequence[dict[str, Any]],
    groups: Sequence[Group],
    dense: dict[str, Any] | None,
    tasks: Sequence[dict[str, Any]],
) -> str:
    """The whole report: its first line is ``command``, which regenerates it."""
    sources = sources_of(args)
    boot = Bootstrap(sources, args.resamples, args.bootstrap_seed)
    targets, counts = target_lines(groups, rows, sources, boot)
    tallies = [f"{label}: {c['met']} met, {c['tie']} ties, {c['loss']} losses" for label, c in counts.items()]
    budgets = budgets_of(args)
    lines = [
        command,
        "",
        f"# Quality at equal budget on {args.model}: GAP's DP against the baselines, chosen on selection, reported on report",
        "",
        f"The command on the first line regenerates this file whole (its argv: `{args.name}.commands.json`); per-window numbers "
        f"are in `{args.name}.jsonl`, window means in `{args.name}.csv`.",
        "",
        machine,
        "",
        *settings_lines(args, groups, sources, dense),
        f"## Targets ({', '.join(f'{b:.0%}' for b in budgets)})",
        "",
        "DP at its default compensation and DP at its best on selection, each against every baseline at its own best on "
        "selection, on every source and on the mean of sources, perplexity and KL, each margin with its 95% interval "
        f"(in all, {'; '.join(tallies)}). On the mean of sources:",
        "",
        *summary_lines(groups, rows, sources, boot),
        "",
        *targets,
        "## Against dense: DP's default plan over the dense model, on the same report windows",
        "",
        *dense_lines(groups, rows, sources, dense, boot),
        "## Each method on the report part: its default and its best on selection",
        "",
        *method_lines(groups, rows, sources, boot, tasks),
        "",
        *task_lines(tasks),
        "",
        "## The choices: mean KL to dense on the selection part",
        "",
        *selection_lines(groups, rows, sources),
        "",
        *(
            ["## The step, on the selection part: DP's plan pruned by its default step or by another", "", *steps, ""]
            if (steps := step_lines(groups, rows, sources, boot))
            else []
        ),
        "## Every row measured on the report part (window means)",
        "",
        "Prune and eval seconds are the pruning and the selection windows' evaluation; the report windows' evaluation is in the JSONL "
        "(`report_s`)."
        + (
            ""
            if getattr(args, "report_every_row", False)
            else " Without `--report-every-row`, only each method's default and best on selection are measured on the report part."
        ),
        "",
        *row_lines(rows, sources, groups),
    ]
    return "\n".join(lines) + "\n"
