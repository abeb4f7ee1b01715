"""Cost of task accuracy through lm-eval against a plain batched forward pass of the same tokens.

    python bench/bench_tasks.py [--limit 25] [--batch-size 4] [--repeats 2] [--out FILE]

Scores SmolLM2-135M on the offline task ``gap_wiki_next`` with ``evaluate.tasks.run_tasks``
(lm-eval's HF backend around the loaded model), then runs the same token sequences lm-eval
builds (context, delimiter and choice encoded as one text, without the last token; longest first, right-padded in batches
of ``--batch-size``) through the model's plain forward pass. The two alternate ``--repeats``
times; process CPU seconds (less sensitive to other load than wall time) and wall seconds are
reported per 1,000 requests, with the machine and the load average (markdown in ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch
from report import command_line, machine_line, script_argv, write_result

from gap_engine.data.next_sentence import OFFLINE_TASK
from gap_engine.evaluate.tasks import TaskSettings, prepare_tasks, run_tasks
from gap_engine.model.loading import load_model

SCRIPT = "bench/bench_tasks.py"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def request_tokens(lm, prepared, limit: int) -> list[list[int]]:
    """The token sequences lm-eval's HF backend feeds the model for the first ``limit`` documents."""
    task = prepared.tasks[OFFLINE_TASK]
    sequences = []
    for doc in list(task.test_docs())[:limit]:
        for choice in task.doc_to_choice(doc):  # lm-eval encodes context + delimiter + choice as one text
            whole = lm.tokenizer(task.doc_to_text(doc) + " " + choice).input_ids
            sequences.append(whole[:-1])
    return sequences


@torch.inference_mode()
def plain_forward(lm, sequences: list[list[int]], batch_size: int) -> None:
    ordered = sorted(sequences, key=len, reverse=True)
    for start in range(0, len(ordered), batch_size):
        batch = ordered[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in batch])  # (B, T) right-padded
        torch.log_softmax(lm.model(input_ids=ids).logits.float(), dim=-1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = script_argv(argv)
    args = build_parser().parse_args(argv)
    load_start, started = os.getloadavg(), time.perf_counter()
    lm = load_model("smollm2-135m")
    prepared = prepare_tasks(TaskSettings(limit=args.limit, batch_size=args.batch_size))
    sequences = request_tokens(lm, prepared, args.limit)
    timings = {"lm_eval": [], "plain": []}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, work in (("lm_eval", lambda: run_tasks(lm, prepared)), ("plain", lambda: plain_forward(lm, sequences, args.batch_size))):
            cpu, wall = cpu_seconds(), time.perf_counter()
            work()
            timings[name].append((cpu_seconds() - cpu, time.perf_counter() - wall))
        load.append(os.getloadavg()[0])
    per_1000 = 1000 / len(sequences)
    result = {
        "requests": len(sequences),
        "tokens": sum(map(len, sequences)),
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": load,
    }
    for name, pairs in timings.items():
        result[f"{name}_cpu_s_per_1000"] = statistics.median(c for c, _ in pairs) * per_1000
        result[f"{name}_wall_s_per_1000"] = statistics.median(w for _, w in pairs) * per_1000
    result["cpu_ratio"] = result["lm_eval_cpu_s_per_1000"] / result["plain_cpu_s_per_1000"]
    result["wall_ratio"] = result["lm_eval_wall_s_per_1000"] / result["plain_wall_s_per_1000"]
    print(json.dumps(result, indent=1))
    if args.out:
        write_result(args.out, report_lines(result, argv, machine_line(load_start, started)), SCRIPT, argv)


def report_lines(result: dict, argv: list[str], machine: str) -> list[str]:
    """The markdown report of one run: per 1,000 requests, lm-eval's path beside the plain forward."""
    return [
        "# Task scoring through lm-eval against a plain batched forward of the same tokens",
        "",
        f"Command: `{command_line(SCRIPT, argv)}`",
        "",
        machine,
        "",
        f"SmolLM2-135M on `{OFFLINE_TASK}`: {result['requests']} likelihood requests ({result['tokens']:,} tokens), "
        f"batches of {result['batch_size']}, {result['torch_threads']} torch threads; lm-eval's scoring "
        "(`evaluate.tasks.run_tasks`) and a plain forward of the same token sequences, alternating; medians. "
        "1-minute load average before and after each pair: " + ", ".join(f"{x:.1f}" for x in result["load_average_1min"]) + ".",
        "",
        "| path | CPU s per 1,000 requests | wall s per 1,000 requests |",
        "|---|---:|---:|",
        f"| lm-eval (gap's wrapper) | {result['lm_eval_cpu_s_per_1000']:.1f} | {result['lm_eval_wall_s_per_1000']:.1f} |",
        f"| plain batched forward | {result['plain_cpu_s_per_1000']:.1f} | {result['plain_wall_s_per_1000']:.1f} |",
        f"| lm-eval / plain | {result['cpu_ratio']:.2f}x | {result['wall_ratio']:.2f}x |",
    ]


if __name__ == "__main__":
    main()
