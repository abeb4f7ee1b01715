"""The markdown of bench_quality.py: its rows per model, and issue 31's targets met or missed."""

from __future__ import annotations

import json
from collections import defaultdict

from report import RESULTS

BASELINES = ("uniform", "flap", "slimgpt", "owl")


def _f(row: dict, key: str) -> float:
    return float(row[key])


def _mean(row: dict, metric: str, sources: list[str]) -> float:
    return sum(_f(row, f"{metric}_{s}") for s in sources) / len(sources)


def commands(args, command: str, machine: str) -> dict:
    """Every model's command and machine line, kept beside the CSV (each model runs in its own process)."""
    path = RESULTS / f"{args.name}.commands.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    known[args.model] = {"command": command, "machine": machine}
    path.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    return known


def settings_lines(args, run, sources: list[str]) -> list[str]:
    table = run.table
    return [
        "## Settings",
        "",
        f"- Calibration: {args.samples} windows x {args.seq_len} tokens of {args.data} (the loss table's; compensation "
        "is fitted and FLAP's fluctuation and SlimGPT's Hessians are measured on them).",
        f"- DP's table: estimator {table.spec.estimator}, objective {table.spec.objective}, criterion {table.spec.criterion}, "
        f"{len(table.rate_grid)} rates; dp, uniform and owl prune by the table's criterion, flap by FLAP's fluctuation metric, "
        "slimgpt by its greedy OBS (criterion obs, whose update is its compensation: it runs with `none`).",
        f"- Held-out: {args.eval_samples} windows x {args.eval_seq_len} tokens per source ({', '.join(sources)}), never "
        "overlapping calibration text; KL is KL(dense || pruned) per token, top-1 the share of positions where the pruned "
        "model's most likely next token is the dense model's.",
        f"- Task: zero-shot accuracy on `gap_wiki_next` (first {args.task_limit} examples), scored for each method's best "
        "compensation at each budget (best: lowest mean held-out KL; marked *).",
        "- Budgets are fractions of the prunable parameters (attention and MLP projections); every method removes at least "
        "the budget and less than one unit more. Load: the 1-minute load average at the start and end of the row (2 cores "
        "shared with other sessions).",
        "",
    ]


def table_lines(rows: list[dict], sources: list[str]) -> list[str]:
    lines = [
        "| budget | allocator | compensation | removed | "
        + " | ".join(f"ppl {s}" for s in sources)
        + " | "
        + " | ".join(f"KL {s}" for s in sources)
        + " | "
        + " | ".join(f"top-1 {s}" for s in sources)
        + " | task acc | prune s | eval s | load |",
        "|---:|---|---|---:|" + "---:|" * (3 * len(sources)) + "---:|---:|---:|---|",
    ]
    order = {a: i for i, a in enumerate(("dp", *BASELINES))}
    for r in sorted(rows, key=lambda r: (_f(r, "budget"), order.get(r["allocator"], 9), r["compensation"])):
        task = f"{_f(r, 'task_acc'):.3f} ± {_f(r, 'task_stderr'):.3f}" if r.get("task_acc") not in (None, "") else ""
        star = "*" if r.get("best") == "yes" else ""
        lines.append(
            f"| {_f(r, 'budget'):.0%} | {r['allocator']} | {r['compensation']}{star} | {_f(r, 'removed_fraction'):.2%} | "
            + " | ".join(f"{_f(r, f'ppl_{s}'):.2f}" for s in sources)
            + " | "
            + " | ".join(f"{_f(r, f'kl_{s}'):.3f}" for s in sources)
            + " | "
            + " | ".join(f"{_f(r, f'top1_{s}'):.3f}" for s in sources)
            + f" | {task} | {_f(r, 'prune_s'):.0f} | {_f(r, 'eval_s'):.0f} | {_f(r, 'load_start'):.1f}-{_f(r, 'load_end'):.1f} |"
        )
    return lines


def best_rows(rows: list[dict]) -> dict[tuple[float, str], dict]:
    """(budget, allocator) -> the row of its best compensation."""
    return {(round(_f(r, "budget"), 4), r["allocator"]): r for r in rows if r.get("best") == "yes"}


def target_lines(rows: list[dict], sources: list[str]) -> list[str]:
    best = best_rows(rows)
    budgets = sorted({b for b, _ in best})
    lines = [
        "Target 1: DP with its best compensation beats every baseline with its own best compensation on held-out "
        "perplexity and KL (both sources) at every budget. Ratio = baseline / DP (above 1: DP better).",
        "",
        "| budget | baseline | " + " | ".join(f"ppl {s}" for s in sources) + " | " + " | ".join(f"KL {s}" for s in sources) + " | met |",
        "|---:|---|" + "---:|" * (2 * len(sources)) + "---|",
    ]
    missed = []
    for budget in budgets:
        dp = best.get((budget, "dp"))
        for name in BASELINES:
            other = best.get((budget, name))
            if dp is None or other is None:
                continue
            ratios = [_f(other, f"ppl_{s}") / _f(dp, f"ppl_{s}") for s in sources] + [
                _f(other, f"kl_{s}") / _f(dp, f"kl_{s}") for s in sources
            ]
            met = all(x > 1 for x in ratios)
            missed += [] if met else [f"{budget:.0%} vs {name}"]
            lines.append(
                f"| {budget:.0%} | {name} ({other['compensation']}) | "
                + " | ".join(f"{x:.3f}" for x in ratios)
                + f" | {'yes' if met else 'no'} |"
            )
    lines += ["", f"Target 1 {'met everywhere' if not missed else 'missed at ' + ', '.join(missed)} on this model.", ""]
    lines += ["Target 2: compensation removes at least 10% of DP's KL to dense at 20% and 25% at 40% (held-out, mean of the sources).", ""]
    for budget, goal in ((0.2, 0.10), (0.4, 0.25)):
        plain = next(
            (r for r in rows if r["allocator"] == "dp" and r["compensation"] == "none" and round(_f(r, "budget"), 4) == budget), None
        )
        top = best.get((budget, "dp"))
        if plain is None or top is None:
            continue
        cut = 1 - _mean(top, "kl", sources) / _mean(plain, "kl", sources)
        verdict = "met" if cut >= goal else "missed"
        lines.append(
            f"- {budget:.0%}: KL {_mean(plain, 'kl', sources):.3f} -> {_mean(top, 'kl', sources):.3f} with {top['compensation']} "
            f"({cut:.0%} removed; target {goal:.0%}: {verdict})."
        )
    lines += [
        "",
        "GAP's paper: \"comparable at 37-50%, clearly better at 25%\". Best baseline's perplexity / DP's (mean of the sources):",
        "",
    ]
    for budget in budgets:
        dp = best.get((budget, "dp"))
        others = [best[budget, name] for name in BASELINES if (budget, name) in best]
        if dp is None or not others:
            continue
        top = min(others, key=lambda r: _mean(r, "ppl", sources))
        lines.append(
            f"- {budget:.0%}: {_mean(top, 'ppl', sources) / _mean(dp, 'ppl', sources):.2f} (best baseline: {top['allocator']} with {top['compensation']})."
        )
    return lines


def report_text(args, command: str, run, machine: str) -> str:
    sources = list(run.heldout)
    known = commands(args, command, machine)
    lines = [
        "# Quality at equal budget: GAP's DP against the field, each with compensation",
        "",
        "Generated by `bench/bench_quality.py`, one process per model:",
        "",
    ]
    for model, entry in sorted(known.items()):
        lines += [f"- {model}:", "", "  ```", f"  {entry['command']}", "  ```", "", f"  {entry['machine']}", ""]
    lines += settings_lines(args, run, sources)
    by_model: dict[str, list[dict]] = defaultdict(list)
    for row in run.rows:
        by_model[row["model"]].append(row)
    for model, rows in sorted(by_model.items()):
        first = rows[0]
        dense = ", ".join(f"{s} {_f(first, f'dense_ppl_{s}'):.3f}" for s in sources)
        task = f"; task accuracy {first['dense_task_acc']}" if first.get("dense_task_acc") else ""
        lines += [f"## {model}", "", f"Dense perplexity {dense}{task}.", ""]
        lines += table_lines(rows, sources) + ["", f"### Targets on {model}", ""] + target_lines(rows, sources) + [""]
    return "\n".join(lines) + "\n"
