"""FLAP's own code on our model, beside our ``flap`` baseline, on the same windows.

Runs the pruning of FLAP's public repository (An et al., AAAI 2024; github.com/CASIA-IVA-Lab/FLAP,
checked out *outside* this project, e.g. ``git archive`` into /work/peers/FLAP) on the built-in
SmolLM2-135M, with its defaults (WIFV metric, AL-AM adaptive structure, bias compensation,
masking as its scripts run it), and our ``flap`` allocator (its plans prune with the ``flap``
criterion) on the same calibration windows; both are scored by the same held-out perplexity
code. FLAP's code is imported from the peer folder and never copied here; its source is
patched at import only where our model or this machine forces it (each patch below says why):

- head_dim: FLAP hard-codes LLaMA-7B's 128; SmolLM2's is 64.
- GQA: FLAP masks k/v rows per query head (LLaMA-1 has one KV head per query head). With
  3 query heads per KV head a removed query head is silenced by zeroing its ``o_proj``
  columns, and k/v rows only go with a whole group; FLAP's global weight of a head against
  a channel (512/3 = 4 * 128 / 3: q, k, v, o rows of one head over a channel's 3 columns)
  becomes (2 + 2 / group) * head_dim / 3.
- float32 on the CPU: FLAP casts its mean inputs to float16 (its model is half on a GPU).
- transformers 5: a decoder block no longer computes its rotary embeddings; the block is
  handed the model's own (``position_embeddings``) when FLAP calls it without them.
- data: FLAP downloads WikiText-2; it reads our calibration windows instead.

``--no-bias`` runs (``compress(bias=False)``, FLAP's own switch) compare the structure search
alone, against ours without compensation.

    python bench/bench_flap_peer.py [--peer /work/peers/FLAP] [--budgets 0.2,0.5]
        [--samples 32 --seq-len 128] [--eval-samples 8 --eval-seq-len 256]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import add_eval_args, command_line, machine_line, script_argv, write_report

SCRIPT = "bench/bench_flap_peer.py"

from gap_engine.core.config import CLI_TABLE, WindowSpec
from gap_engine.core.fsutil import cache_root
from gap_engine.data.windows import calibration_windows
from gap_engine.evaluate.metrics import mean_nll
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.loading import load_model
from gap_engine.model.slicing import replace_linear_
from gap_engine.pipeline.compare import heldout_sets
from gap_engine.pipeline.stages import loss_table
from gap_engine.plan.allocators import plan_from_table
from gap_engine.prune.compensation_pass import prune_compensated
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import compute_importance, flap_standardised, input_statistics
from gap_engine.tables.artefact import TableSpec

log = logging.getLogger("bench_flap_peer")
# (our row, FLAP run compared: with its bias compensation or not, our compensation)
OURS = (
    ("none", False, CompensationSettings("none")),
    ("bias", True, CompensationSettings("bias")),
    ("bias, dense-stream means", True, CompensationSettings("bias", target="dense")),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", default="/work/peers/FLAP", help="FLAP's repository, checked out outside the project")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budgets", default="0.2,0.5")
    p.add_argument("--samples", type=int, default=32, help="calibration windows (FLAP's default is 1024; its code runs them one by one)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per calibration window (FLAP's default)")
    add_eval_args(p)
    p.add_argument("--name", default="flap_peer")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# ---- FLAP's code, imported from the peer folder --------------------------------------------------
def _patches(head_dim: int, group: int) -> list[tuple[str, str, int]]:
    """(FLAP's text, what runs instead, how often it occurs): only what our model or this machine forces."""
    return [
        ("attn_mask.repeat_interleave(128)", f"attn_mask.repeat_interleave({head_dim})", 2),
        ("attn_metric.reshape(len(layers), -1, 128)", f"attn_metric.reshape(len(layers), -1, {head_dim})", 1),
        ("= 512.0 / 3", f"= {(2 + 2 / group) * head_dim / 3!r}", 1),
        (".type(torch.half)", ".float()", 2),
        (
            "layer.self_attn.k_proj.weight.data *= attn_mask.unsqueeze(-1).to(device)",
            "layer.self_attn.k_proj.weight.data *= GQA_KV_ROWS(attn_mask).unsqueeze(-1).to(device)",
            1,
        ),
        (
            "layer.self_attn.v_proj.weight.data *= attn_mask.unsqueeze(-1).to(device)",
            "layer.self_attn.v_proj.weight.data *= GQA_KV_ROWS(attn_mask).unsqueeze(-1).to(device)",
            1,
        ),
        (
            "                layer.self_attn.o_proj.bias.data = output_bias\n            layer.self_attn.o_proj.weight.data = output_weight\n",
            "                layer.self_attn.o_proj.bias.data = output_bias\n"
            "            layer.self_attn.o_proj.weight.data = output_weight * attn_mask.to(device)\n",
            1,
        ),
        ("bias=True, unstr=False):", "bias=PEER_BIAS, unstr=False):", 1),
    ]


def load_flap(peer: Path, head_dim: int, n_heads: int, n_kv: int, bias: bool, windows: torch.Tensor) -> types.ModuleType:
    """FLAP's ``lib.prune``, its source patched as `_patches` lists, reading ``windows`` as its data."""
    sys.path.insert(0, str(peer))
    package = importlib.import_module("lib")
    importlib.import_module("lib.layerwrapper")
    source = (peer / "lib" / "prune.py").read_text()
    for old, new, count in _patches(head_dim, n_heads // n_kv):
        found = source.count(old)
        if found != count:
            raise SystemExit(f"FLAP's lib/prune.py changed: '{old[:60]}' occurs {found} times, expected {count}")
        source = source.replace(old, new)
    module = types.ModuleType("lib.prune")
    module.__package__ = package.__name__
    module.__file__ = str(peer / "lib" / "prune.py")
    sys.modules["lib.data"] = types.ModuleType("lib.data")  # FLAP's loader downloads; never called here
    sys.modules["lib.data"].get_loaders = None
    group = n_heads // n_kv

    def kv_rows(row_mask: torch.Tensor) -> torch.Tensor:
        # a KV head stays while any query head of its group does
        return row_mask.reshape(n_kv, group, head_dim).any(1).reshape(-1)

    module.GQA_KV_ROWS = kv_rows
    module.PEER_BIAS = bias  # read when compress is defined (its default)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    module.get_loaders = lambda *a, **k: ([(w[None], None) for w in windows], None)
    return module


def _give_blocks_rotary(model) -> None:
    """transformers 5's decoder block takes its rotary embeddings from the model; FLAP calls blocks alone."""
    block_class = type(model.model.layers[0])
    if getattr(block_class, "_flap_bench_rotary", False):
        return
    forward = block_class.forward
    rotary = model.model.rotary_emb

    def with_rotary(self, hidden_states, *args, **kwargs):
        if kwargs.get("position_embeddings") is None:
            positions = kwargs.get("position_ids")
            if positions is None:
                positions = torch.arange(hidden_states.shape[1])[None]
            kwargs["position_embeddings"] = rotary(hidden_states, positions)
        return forward(self, hidden_states, *args, **kwargs)

    block_class.forward = with_rotary
    block_class._flap_bench_rotary = True


def peer_prune(folder: Path, tokenizer, args, budget: float, bias: bool, windows: torch.Tensor):
    """FLAP's own pruning of a fresh copy of the model: (model, removed prunable parameters, kept per block)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    for layer in model.model.layers:  # FLAP's get_llm: zero biases its compensation writes into
        layer.self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(layer.self_attn.o_proj.out_features))
        layer.mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(layer.mlp.down_proj.out_features))
    model.seqlen = windows.shape[1]
    _give_blocks_rotary(model)
    cfg = model.config
    flap = load_flap(Path(args.peer), cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias, windows)
    flap_args = argparse.Namespace(
        pruning_ratio=budget, metrics="WIFV", structure="AL-AM", nsamples=len(windows), remove_heads=-1, unstr=True, seed=0
    )
    with torch.no_grad():
        flap.prune_flap(flap_args, model, tokenizer, torch.device("cpu"))
    return (model, *masked_structure(model))


def masked_structure(model) -> tuple[int, list[tuple[int, int]]]:
    """Prunable parameters FLAP's masks remove (per head its q rows and o columns, k/v with a
    whole group, per channel its gate/up rows and down column) and (heads, channels) kept per block."""
    cfg = model.config
    hidden, head_dim, group = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    removed, kept = 0, []
    for layer in model.model.layers:
        heads_gone = (layer.self_attn.o_proj.weight.reshape(hidden, -1, head_dim).abs().sum((0, 2)) == 0).reshape(-1, group)  # (KV, G)
        channels_gone = int((layer.mlp.up_proj.weight.abs().sum(1) == 0).sum())
        removed += int(heads_gone.sum()) * 2 * hidden * head_dim + int(heads_gone.all(1).sum()) * 2 * hidden * head_dim
        removed += channels_gone * 3 * hidden
        kept.append((heads_gone.numel() - int(heads_gone.sum()), layer.mlp.up_proj.out_features - channels_gone))
    return removed, kept


# ---- our metric with FLAP's freedom: heads one by one, masked -------------------------------------
def masked_ours(dense: LoadedModel, windows: torch.Tensor, target: float, bias: bool) -> LoadedModel:
    """A copy of ``dense`` with the units our FLAP metric and global threshold remove (``target``
    parameters, a head counted with its share of k/v, as FLAP counts) zeroed one by
    one, heads included (as FLAP's code masks them; no GQA model ships so), and with ``bias``
    FLAP's own compensation (the removed inputs' dense-stream mean times their columns).

    A diagnostic: it equals FLAP's code up to our statistics, so what it loses against our
    shippable ``flap`` is the GQA rounding, and what it differs from FLAP's code is the rest."""
    z = flap_standardised(dense, windows, 8)
    layers = dense.adapter.layers(dense.model)
    linears = {}
    for i, layer in enumerate(layers):
        linears[i, "o"], linears[i, "down"] = dense.adapter.attention_projections(layer)[3], dense.adapter.mlp_projections(layer)[2]
    stats = input_statistics(dense, windows, linears, 8)
    units = []  # (z, parameters freed, layer, kind, index)
    for i, layer in enumerate(layers):
        g = dense.adapter.geometry(layer)
        hidden = linears[i, "o"].out_features
        units += [(float(v), 2 * hidden * g.head_dim * (1 + 1 / g.group_size), i, "o", h) for h, v in enumerate(z[i].head)]
        units += [(float(v), 3 * hidden, i, "down", c) for c, v in enumerate(z[i].channel)]
    removed: dict[tuple[int, str], list[int]] = {}
    freed = 0.0
    for _, params, i, kind, index in sorted(units):
        if freed >= target:
            break
        removed.setdefault((i, kind), []).append(index)
        freed += params
    pruned = dense.copy()
    for i, layer in enumerate(pruned.adapter.layers(pruned.model)):
        for kind, owner, name in (
            ("o", pruned.adapter.attention(layer), pruned.adapter.output_name),
            ("down", pruned.adapter.mlp(layer), pruned.adapter.down_name),
        ):
            units_gone = removed.get((i, kind), [])
            if not units_gone:
                continue
            width = dense.adapter.geometry(layer).head_dim if kind == "o" else 1
            cols = torch.tensor([u * width + k for u in units_gone for k in range(width)])
            linear = getattr(owner, name)
            with torch.no_grad():
                if bias:
                    mean = (stats[i, kind].total / stats[i, kind].count).float()
                    replace_linear_(owner, name, bias=linear.weight[:, cols] @ mean[cols], add_bias=True)
                getattr(owner, name).weight[:, cols] = 0.0
    return pruned


# ---- the run ---------------------------------------------------------------------------------------
def heldout_ppl(lm: LoadedModel, heldout: dict) -> dict[str, float]:
    return {source: math.exp(mean_nll(lm, w, 4)) for source, w in heldout.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    argv = script_argv(argv)
    command = command_line(SCRIPT, argv)
    load_start, started = os.getloadavg(), time.perf_counter()
    dense = load_model(args.model)
    folder = Path(dense.source) if Path(dense.source).is_dir() else cache_root() / "models" / args.model
    calib = WindowSpec(data="wiki-sample", n_samples=args.samples, seq_len=args.seq_len, batch_size=8)
    windows = calibration_windows(dense.tokenizer, calib)
    heldout = heldout_sets(dense.tokenizer, WindowSpec(data=args.eval_data, n_samples=args.eval_samples, seq_len=args.eval_seq_len))
    table_windows = WindowSpec(
        data=CLI_TABLE.windows.data, n_samples=CLI_TABLE.windows.n_samples, seq_len=CLI_TABLE.windows.seq_len, batch_size=8
    )
    spec = TableSpec(
        windows=table_windows,
        criterion="wanda",
        rate_grid=CLI_TABLE.rate_grid,
        estimator=CLI_TABLE.estimator,
        objective=CLI_TABLE.objective,
    )
    table = loss_table(dense, spec)  # the default table: its losses are not read, its geometry is (FLAP plans off-grid)
    dense_ppl = heldout_ppl(dense, heldout)
    scores = compute_importance(dense, windows, "flap", 8)
    rows, structures = [], []
    for budget in [float(b) for b in args.budgets.split(",") if b]:
        peer = {}
        for bias in (False, True):
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            model, removed, kept = peer_prune(folder, dense.tokenizer, args, budget, bias, windows)
            peer[bias] = (heldout_ppl(LoadedModel.from_transformers(model, dense.tokenizer, "flap-peer", "peer"), heldout), removed)
            peer[bias] += (time.perf_counter() - t0, load0, kept)
            del model
        # our budget as asked, and as much as FLAP's code removed (k/v rows stay with any kept head of their group)
        for ours_budget in (budget, peer[False][1] / table.dense_prunable):
            plan = plan_from_table(dense, table, ours_budget, "flap", windows=windows, scores=scores)
            for label, bias, settings in OURS:
                t0 = time.perf_counter()
                pruned = dense.copy()
                result = prune_compensated(pruned, plan, scores, calib, settings)
                ours = heldout_ppl(pruned, heldout)
                ppl, removed, peer_s, load0, peer_kept = peer[bias]
                rows.append((budget, label, removed, plan.params["removed"], ppl, ours, peer_s, time.perf_counter() - t0, load0))
                log.info("budget %.0f%% (ours %.2f%%) %s: FLAP %s ours %s", 100 * budget, 100 * ours_budget, label, ppl, ours)
            ours_kept = [(len(h), len(c)) for h, c in zip(result.kept_heads, result.kept_channels)]
        structures.append((budget, peer[False][4], ours_kept))
        for bias in (False, True):
            t0 = time.perf_counter()
            ours = heldout_ppl(masked_ours(dense, windows, budget * table.dense_prunable, bias), heldout)  # FLAP's accounting
            ppl, removed, peer_s, load0, _ = peer[bias]
            label = "ours masked head by head" + (", FLAP's bias" if bias else "")
            rows.append((budget, label, removed, peer[False][1], ppl, ours, peer_s, time.perf_counter() - t0, load0))
            log.info("budget %.0f%% %s: FLAP %s ours %s", 100 * budget, label, ppl, ours)
    lines = report_lines(args, command, dense, table, dense_ppl, rows, machine_line(load_start, started))
    lines += structure_lines(structures)
    write_report(args.name, lines, SCRIPT, argv)
    return 0


def report_lines(args, command, dense, table, dense_ppl, rows, machine) -> list[str]:
    sources = list(dense_ppl)
    lines = [
        f"# FLAP's own code against our `flap` baseline: {args.model}",
        "",
        "Generated by `bench/bench_flap_peer.py` (FLAP's code imported from the peer checkout, patched at import as the script's docstring lists):",
        "",
        "```",
        command,
        "```",
        "",
        machine,
        "",
        f"Calibration: {args.samples} windows x {args.seq_len} tokens of wiki-sample, the same for both. Held-out: "
        f"{args.eval_samples} windows x {args.eval_seq_len} tokens per source, scored by the same code. Dense perplexity: "
        + ", ".join(f"{s} {dense_ppl[s]:.3f}" for s in sources)
        + f". Budgets are fractions of the {table.dense_prunable:,} prunable parameters.",
        "",
        "| budget | compensation (ours; FLAP's code with its bias unless none) | removed: FLAP | removed: ours | "
        + " | ".join(f"ppl {s}: FLAP | ours | ours / FLAP" for s in sources)
        + " | FLAP s | ours s | load |",
        "|---:|---|---:|---:|" + "---:|---:|---:|" * len(sources) + "---:|---:|---:|",
    ]
    for budget, label, peer_removed, our_removed, peer, ours, peer_s, our_s, load in rows:
        cells = [f"{peer[s]:.2f} | {ours[s]:.2f} | {ours[s] / peer[s]:.3f}" for s in sources]
        lines.append(
            f"| {budget:.0%} | {label} | {peer_removed / table.dense_prunable:.2%} | "
            f"{our_removed / table.dense_prunable:.2%} | {' | '.join(cells)} | {peer_s:.0f} | {our_s:.0f} | {load:.1f} |"
        )
    return lines


def structure_lines(structures) -> list[str]:
    """Heads and channels each block keeps: FLAP's code against ours at FLAP's removed count."""
    lines = []
    for budget, peer, ours in structures:
        lines += [
            "",
            f"Kept per block at {budget:.0%} (heads / MLP channels; ours at the parameter count FLAP's code removed):",
            "",
            "| | " + " | ".join(str(i) for i in range(len(peer))) + " |",
            "|---|" + "---:|" * len(peer),
            "| FLAP heads | " + " | ".join(str(h) for h, _ in peer) + " |",
            "| ours heads | " + " | ".join(str(h) for h, _ in ours) + " |",
            "| FLAP channels | " + " | ".join(str(c) for _, c in peer) + " |",
            "| ours channels | " + " | ".join(str(c) for _, c in ours) + " |",
        ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
