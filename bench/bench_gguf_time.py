"""The Export page's GGUF build time: the cost model's prediction against real builds.

The Export page says how long building a checkpoint's GGUF file will take before the user
clicks (``pipeline.expected.gguf_seconds``). A first build in a process also imports
transformers' model code (seconds on a cold disk cache), which a process that loaded a model
earlier, like the explorer after a run, does not pay again; the prediction prices that import
only where it is still to come. This benchmark builds the GGUF bytes of pruned SmolLM2-135M
checkpoints (uniform plans at the given budgets, saved in bfloat16) at f16 and q8_0:

- cold: each build alone in a fresh Python process (the imports paid, as a first click);
- warm: every build repeated in one process that has built once already (as the explorer).

It prints predicted and measured seconds side by side and their ratio (wall; CPU seconds
beside it, which a busy machine stretches less). Target: every ratio within 0.5-2x.

    python bench/bench_gguf_time.py [--budgets 0.2,0.4] [--repeats 3] [--workdir runs/bench_gguf_time]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import machine_line, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUTTYPES = ("f16", "q8_0")

# One build, timed, with the prediction taken just before it in the same process.
BUILD = """
import json, sys, time
from gap_engine.deploy import gguf
from gap_engine.pipeline.expected import gguf_seconds
folder, outtype, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
for _ in range(repeats):
    predicted, wall, cpu = gguf_seconds(folder, outtype), time.perf_counter(), time.process_time()
    size = len(gguf.gguf_bytes(folder, outtype))
    rows.append({"predicted": predicted, "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "bytes": size})
print(json.dumps(rows))
"""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="0.2,0.4", help="uniform pruning budgets of the checkpoints")
    parser.add_argument("--repeats", type=int, default=3, help="warm builds of each checkpoint and outtype")
    parser.add_argument("--workdir", default="runs/bench_gguf_time")
    return parser.parse_args(argv)


def run(command: list[str], commands: list[str]) -> str:
    commands.append(" ".join(["python", *command[1:]]))
    done = subprocess.run(command, cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=True)
    return done.stdout


def builds(folder: Path, outtype: str, repeats: int) -> list[dict]:
    """``repeats`` builds in one fresh process: the first cold, the rest warm."""
    output = subprocess.run(
        [sys.executable, "-c", BUILD, str(folder), outtype, str(repeats)],
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    load_start, started, commands = os.getloadavg(), time.perf_counter(), []
    rows, ratios = [], []
    for budget in [float(b) for b in args.budgets.split(",")]:
        folder = work / f"uniform-{budget:g}"
        if not (folder / "config.json").exists():
            run(
                [sys.executable, "-m", "gap_engine", "prune", "--model", "smollm2-135m", "--uniform", f"{budget:g}", "--out", str(folder)],
                commands,
            )
        for outtype in OUTTYPES:
            measured = builds(folder, outtype, 1 + args.repeats)
            for kind, picked in (("cold", measured[:1]), ("warm", measured[1:])):
                predicted = statistics.median(r["predicted"] for r in picked)
                wall, cpu = statistics.median(r["wall"] for r in picked), statistics.median(r["cpu"] for r in picked)
                ratios.append(predicted / wall)
                rows.append(
                    f"| {budget:.0%} | {outtype} | {kind} ({len(picked)}) | {measured[0]['bytes'] / 1e6:.0f} MB | {predicted:.2f} s | "
                    f"{wall:.2f} s | {cpu:.2f} s | **{predicted / wall:.2f}** | {predicted / cpu:.2f} |"
                )
    lines = [
        "# GGUF build time: predicted against measured (Export page)",
        "",
        "```",
        f"python bench/bench_gguf_time.py {' '.join(argv or sys.argv[1:])}",
        "```",
        "",
        "which ran first (checkpoints it had not made already):",
        "",
        "```",
        *(commands or ["(none: the checkpoints were there)"]),
        "```",
        "",
        machine_line(load_start, started),
        "",
        "cold: the first build in a fresh process (imports transformers' model code); warm: later builds in the same "
        "process (median). predicted: `pipeline.expected.gguf_seconds` just before the build, in the same process.",
        "",
        "| budget | outtype | builds | file | predicted | wall | CPU | predicted / wall | predicted / CPU |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Ratios (predicted / wall) from {min(ratios):.2f} to {max(ratios):.2f}; target 0.5-2: "
        f"{'met' if all(0.5 <= r <= 2.0 for r in ratios) else 'NOT met'}.",
    ]
    write_report("gguf_time", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
