"""Deployment benchmark: pruned SmolLM2-135M as GGUF in llama.cpp, against the dense GGUF.

For budgets 0 (dense) / 10 / 20 / 30% of the prunable parameters (DP plans from a Fisher
KL loss table, made with the documented `gap table` / `gap plan` / `gap prune` commands),
exports every model with `gap export --format gguf` at f16 and q8_0 and measures, side by
side in one run:

- the GGUF file size;
- llama.cpp prefill and decode tokens/s (every repeat times all models in turn, so machine
  noise hits them alike; median and min-max over the repeats, ratio to the dense GGUF of
  the same outtype);
- agreement with PyTorch on held-out text never seen in calibration: top-1 agreement of
  llama.cpp's and PyTorch's next-token argmax, and both perplexities on the same tokens.

Targets: top-1 agreement >= 0.95 at f16 and perplexity within 1% of PyTorch; decode
speed-up at 30% >= 1.2x over dense. Decode reads every weight once per token, so the LM
head (tied to the 49152 x 576 embedding) caps the speed-up; the report prints that bound.

    python bench/bench_deploy.py [--budgets 0,0.1,0.2,0.3] [--outtypes f16,q8_0] [--repeats 5]
        [--prompt-tokens 256] [--decode-tokens 64] [--eval-samples 8] [--eval-seq-len 256]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import RESULTS, command_line, machine_line, script_argv, with_header

from gap_engine.cli import main as gap
from gap_engine.core.config import WindowSpec
from gap_engine.core.fsutil import atomic_write_text
from gap_engine.data.windows import heldout_windows
from gap_engine.model.loading import load_model

log = logging.getLogger("bench_deploy")
SCRIPT = "bench/bench_deploy.py"
MODEL = "smollm2-135m"
TABLE_ARGS = [
    "--estimator",
    "fisher",
    "--objective",
    "kl",
    "--samples",
    "16",
    "--seq-len",
    "256",
    "--rates",
    "0,0.125,0.25,0.375,0.5,0.625,0.75,0.875",
]
PRUNE_ARGS = ["--samples", "16", "--seq-len", "256"]
METRICS = ("prefill_cpu", "decode_cpu", "prefill_wall", "decode_wall")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="0,0.1,0.2,0.3")
    p.add_argument("--outtypes", default="f16,q8_0")
    p.add_argument("--repeats", type=int, default=7, help="timing repeats per model")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prefill length")
    p.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens decoded after the prompt")
    # One thread: on a shared 2-core machine two llama.cpp threads wait on each other at every
    # synchronisation point whenever one is descheduled (measured 4x slower decode under load).
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    p.add_argument("--eval-data", default="wiki-sample")
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--eval-seq-len", type=int, default=256)
    p.add_argument("--workdir", default="runs/bench_deploy", help="tables, plans, checkpoints and GGUF files")
    p.add_argument("--out", default=str(RESULTS / "deploy.md"))
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run_gap(argv: list[str], commands: list[str]) -> None:
    commands.append("gap " + " ".join(argv))
    log.info("$ %s", commands[-1])
    if gap(argv) != 0:
        raise SystemExit(f"command failed: gap {' '.join(argv)}")


def make_models(args, work: Path, commands: list[str]) -> dict[float, str]:
    """Budget -> model to export: the dense built-in at 0, DP-pruned checkpoints otherwise."""
    table = work / "t.json"
    if not table.is_file():
        run_gap(["table", "--model", MODEL, *TABLE_ARGS, "--out", str(table)], commands)
    models = {}
    for budget in [float(b) for b in args.budgets.split(",")]:
        if budget == 0:
            models[budget] = MODEL
            continue
        plan, ckpt = work / f"p{budget:g}.json", work / f"ckpt-{budget:g}"
        run_gap(["plan", "--table", str(table), "--budget", f"{budget:g}", "--out", str(plan)], commands)
        if not (ckpt / "gap_pruned.json").is_file():
            run_gap(["prune", "--model", MODEL, "--plan", str(plan), *PRUNE_ARGS, "--out", str(ckpt)], commands)
        models[budget] = str(ckpt)
    return models


def llama(path: Path, threads: int, logits_all: bool, n_ctx: int):
    from llama_cpp import Llama

    # Flash attention, as llama.cpp's own CLI enables on CPU: without it llama.cpp pads every
    # layer's V cache to the widest layer's, undoing the KV savings of pruned layers.
    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        flash_attn=True,
        verbose=False,
    )


def time_once(llm, prompt: list[int], decode_tokens: int) -> dict[str, float]:
    """Prefill and greedy-decode rates of one prompt, per wall-clock second and per CPU second.

    With one thread llama.cpp computes on the calling thread, so the process's CPU time is its
    compute time: unlike wall time, it does not grow while a busy machine deschedules us.
    """
    llm.reset()
    wall, cpu = time.perf_counter(), time.process_time()
    llm.eval(prompt)
    rates = {"prefill_wall": len(prompt) / (time.perf_counter() - wall), "prefill_cpu": len(prompt) / (time.process_time() - cpu)}
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(decode_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    rates["decode_wall"] = decode_tokens / (time.perf_counter() - wall)
    rates["decode_cpu"] = decode_tokens / (time.process_time() - cpu)
    return rates


def llama_cpp_quality(path: Path, windows: torch.Tensor, threads: int) -> list[np.ndarray]:
    """Per window, llama.cpp's logits of every position: (T, V) arrays."""
    llm = llama(path, threads, logits_all=True, n_ctx=windows.shape[1])
    out = []
    for window in windows.tolist():
        llm.reset()
        llm.eval(window)
        out.append(np.array(llm.scores[: len(window)], dtype=np.float32))
    llm.close()
    return out


def nll_and_argmax(logits: np.ndarray, window: list[int]) -> tuple[float, np.ndarray]:
    """Summed next-token NLL over the window and the argmax of every position but the last."""
    logp = torch.log_softmax(torch.from_numpy(logits[:-1]).double(), -1)  # (T-1, V)
    targets = torch.tensor(window[1:])
    return float(-logp[torch.arange(len(targets)), targets].sum()), logits[:-1].argmax(-1)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def decode_bound(lm) -> dict:
    """Weights a decode step reads: the LM head and the blocks (embedding lookup is one row)."""
    head = lm.adapter.lm_head(lm.model).weight.numel()
    blocks = sum(p.numel() for layer in lm.adapter.layers(lm.model) for p in layer.parameters())
    return {"head": head, "blocks": blocks}


def main(argv=None) -> int:
    argv = script_argv(argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(2)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    commands: list[str] = []
    models = make_models(args, work, commands)
    outtypes = args.outtypes.split(",")

    # GGUF files, PyTorch references and the weights a decode step reads
    files, reference, bounds, removed = {}, {}, {}, {}
    tokenizer = load_model(MODEL).tokenizer  # every pruned model keeps the dense model's tokenizer
    windows = heldout_windows(tokenizer, WindowSpec(data=args.eval_data, n_samples=args.eval_samples, seq_len=args.eval_seq_len))
    for budget, model in models.items():
        for outtype in outtypes:
            path = work / f"smol-{budget:g}-{outtype}.gguf"
            run_gap(["export", model, "--format", "gguf", "--outtype", outtype, "--out", str(path)], commands)
            files[budget, outtype] = path
        lm = load_model(model)
        bounds[budget] = decode_bound(lm)
        plan = (lm.pruned_from or {}).get("plan") or {}
        removed[budget] = (plan.get("params") or {}).get("removed_fraction_of_prunable", 0.0)
        with torch.inference_mode():
            reference[budget] = [lm.model(input_ids=w[None], use_cache=False).logits[0].float().numpy() for w in windows]
        del lm

    # agreement with PyTorch on held-out windows
    quality = {}
    for (budget, outtype), path in files.items():
        got = llama_cpp_quality(path, windows, args.threads)
        agree = total = 0
        nll_cpp = nll_torch = 0.0
        for window, cpp, torch_logits in zip(windows.tolist(), got, reference[budget]):
            n_c, arg_c = nll_and_argmax(cpp, window)
            n_t, arg_t = nll_and_argmax(torch_logits, window)
            nll_cpp, nll_torch = nll_cpp + n_c, nll_torch + n_t
            agree += int((arg_c == arg_t).sum())
            total += len(window) - 1
        quality[budget, outtype] = {
            "top1": agree / total,
            "ppl_cpp": math.exp(nll_cpp / total),
            "ppl_torch": math.exp(nll_torch / total),
        }
        log.info("quality %s %s: %s", budget, outtype, quality[budget, outtype])

    # speed: every repeat times every model in turn
    prompt = windows[0].tolist()[: args.prompt_tokens]
    if len(prompt) < args.prompt_tokens:
        prompt = heldout_windows(tokenizer, WindowSpec(data=args.eval_data, n_samples=1, seq_len=args.prompt_tokens, seed=1))[0].tolist()
    n_ctx = args.prompt_tokens + args.decode_tokens + 8
    engines = {key: llama(path, args.threads, logits_all=False, n_ctx=n_ctx) for key, path in files.items()}
    for llm in engines.values():  # warm-up: page the weights in
        time_once(llm, prompt[:32], 4)
    timings = {key: {metric: [] for metric in METRICS} for key in engines}
    for repeat in range(args.repeats):
        for key, llm in engines.items():
            for metric, rate in time_once(llm, prompt, args.decode_tokens).items():
                timings[key][metric].append(rate)
        log.info("timing repeat %d/%d done", repeat + 1, args.repeats)
    for llm in engines.values():
        llm.close()

    report = render(args, argv, commands, models, outtypes, files, quality, timings, bounds, removed, machine_line(load_before, started))
    text = with_header(report, SCRIPT, argv)
    atomic_write_text(args.out, text)
    print(text, end="")
    return 0


def _speed(timings: dict, key, dense_key, metric: str) -> str:
    values = timings[key][metric]
    ratio = statistics.median(values) / statistics.median(timings[dense_key][metric])
    return f"{spread(values)} | {ratio:.2f}x"


def render(args, argv, commands, models, outtypes, files, quality, timings, bounds, removed, machine: str) -> str:
    import llama_cpp

    budgets = list(models)
    lines = [
        "# Deploying pruned SmolLM2-135M: GGUF in llama.cpp against the dense GGUF",
        "",
        "Generated by `bench/bench_deploy.py` (in the background, once):",
        "",
        "```",
        command_line(SCRIPT, argv),
        "```",
        "",
        "which ran, in this order:",
        "",
        "```",
        *commands,
        "```",
        "",
        machine,
        "",
        f"llama.cpp through llama-cpp-python {llama_cpp.__version__}, {args.threads} thread(s), flash attention on.",
        "",
        "## Size and agreement with PyTorch",
        "",
        f"{args.eval_samples} held-out {args.eval_data} windows x {args.eval_seq_len} tokens (never in calibration); "
        "the same token ids go to llama.cpp and to PyTorch (float32, the checkpoint as gap loads it). "
        "Top-1 = share of positions whose next-token argmax agrees; perplexity of each on the same tokens.",
        "",
        "| budget | removed (of prunable) | outtype | GGUF MiB | size vs dense | top-1 agreement | ppl llama.cpp | ppl PyTorch | ppl difference |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for outtype in outtypes:
        dense_size = files[budgets[0], outtype].stat().st_size
        for budget in budgets:
            key, q = (budget, outtype), quality[budget, outtype]
            size = files[key].stat().st_size
            lines.append(
                f"| {budget:.0%} | {removed[budget]:.2%} | {outtype} | {size / 2**20:.1f} | {size / dense_size:.3f} "
                f"| {q['top1']:.4f} | {q['ppl_cpp']:.3f} | {q['ppl_torch']:.3f} | {q['ppl_cpp'] / q['ppl_torch'] - 1:+.2%} |"
            )
    lines += [
        "",
        "## Speed",
        "",
        f"{args.repeats} repeats; each repeat times every model in turn: prefill of a {args.prompt_tokens}-token held-out "
        f"prompt, then {args.decode_tokens} greedy tokens one at a time. Tokens per CPU second of the llama.cpp "
        "thread (it computes on the calling thread, so descheduling by other jobs does not count) and per "
        "wall-clock second; median (min-max); speed-up = median over the dense GGUF's median at the same outtype.",
        "",
        "| budget | outtype | prefill tok/CPU-s | speed-up | decode tok/CPU-s | speed-up | prefill tok/s (wall) | speed-up "
        "| decode tok/s (wall) | speed-up |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for outtype in outtypes:
        dense_key = (budgets[0], outtype)
        for budget in budgets:
            key = (budget, outtype)
            cells = " | ".join(_speed(timings, key, dense_key, metric) for metric in METRICS)
            lines.append(f"| {budget:.0%} | {outtype} | {cells} |")
    dense = bounds[budgets[0]]
    lines += ["", "## The LM head's share of a decode step", ""]
    lines.append(
        f"A decode step multiplies the hidden state by every block weight once and by the LM head "
        f"({dense['head']:,} weights, tied to the embedding). Dense: {dense['blocks']:,} block weights + "
        f"{dense['head']:,} head = {dense['blocks'] + dense['head']:,}. If decode time followed the weights "
        "read, the best speed-up would be (head + dense blocks) / (head + pruned blocks):"
    )
    lines.append("")
    for budget in budgets[1:]:
        b = bounds[budget]
        bound = (dense["head"] + dense["blocks"]) / (b["head"] + b["blocks"])
        no_head = dense["blocks"] / b["blocks"]
        lines.append(f"- {budget:.0%}: {b['blocks']:,} block weights -> bound {bound:.2f}x (blocks alone would give {no_head:.2f}x)")
    top = budgets[-1]
    lines += ["", "## Targets", ""]
    if "f16" in outtypes:
        f16 = [quality[b, "f16"] for b in budgets]
        worst_top1 = min(q["top1"] for q in f16)
        worst_ppl = max(abs(q["ppl_cpp"] / q["ppl_torch"] - 1) for q in f16)
        lines.append(f"- top-1 agreement >= 0.95 at f16: worst {worst_top1:.4f} -> {'met' if worst_top1 >= 0.95 else 'NOT met'}")
        lines.append(f"- perplexity within 1% at f16: worst {worst_ppl:.2%} -> {'met' if worst_ppl <= 0.01 else 'NOT met'}")
    for outtype in outtypes:
        for metric in ("decode_cpu", "decode_wall"):
            ratio = statistics.median(timings[top, outtype][metric]) / statistics.median(timings[budgets[0], outtype][metric])
            lines.append(
                f"- decode speed-up at {top:.0%} ({outtype}, {metric.replace('_', ' per ')}) >= 1.2x: {ratio:.2f}x "
                f"-> {'met' if ratio >= 1.2 else 'NOT met'}"
            )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
