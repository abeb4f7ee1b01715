"""What a loss-table build will cost before it runs: time and peak memory (``gap table --dry-run``).

The prediction counts the work exactly the way the builders do it, and prices it with a
device profile:

- **work**: the distinct cells of the grid (rates rounding to the same heads or channels are
  measured once, ``units``), each running blocks ``i..L-1`` and the LM head over N x T
  tokens; one forward for the importance scores and one dense pass; for the gradient
  estimators a forward and one (taylor) or two (fisher) backward passes; for ``refine`` a
  fisher pass plus ``REFINE_CELLS`` measured cells per component (an assumption about the
  refine estimator, stated in the report). Matmul FLOPs are ``2 x parameters`` per token;
  attention adds ``2 x T x heads x head_dim`` per token (causal: half of the full T x T).
- **prices**: a ``DeviceProfile`` gives FLOP/s for blocks and for the LM head with its
  softmax, device memory bandwidth, and the host-to-device link (streaming). It is
  *measured on this machine* (a one-layer model of the target's shape, capped in width so
  it stays small, timed once and cached under ``cache/costmodel/``) or taken from a spec
  sheet (``SPEC_PROFILES``: peak x an assumed utilisation).
- **memory**: weights, the stored dense block inputs (N x T x d per block), the final
  states and stored log-probabilities, and one batch's working set (the widest activation
  and the float32 logits); streamed builds keep one block on the device and the rest on the
  host; Ray workers hold the blocks from their first layer on.

Nothing here builds or loads the model (a config, or a named shape, is enough), so a dry
run answers in seconds; the first one on a machine spends a few seconds calibrating.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gap_engine.core.fsutil import atomic_write_json, cache_root
from gap_engine.core.progress import CELLS, DENSE_PASS, GRADIENT_PASS, SCORE_UNITS
from gap_engine.model.adapters import LayerGeometry
from gap_engine.model.units import ComponentGeometry, attention_shape_for_rate, channels_for_rate
from gap_engine.tables.exact import MAX_STORED_LOGPROB_BYTES
from gap_engine.tables.streaming import STREAM_GROUP_BYTES

if TYPE_CHECKING:
    import torch

    from gap_engine.core.device import DeviceSpec, Placement
    from gap_engine.tables.artefact import TableSpec

log = logging.getLogger(__name__)

REFINE_CELLS = 4  # measured cells per component assumed for refine: 3.8 measured on SmolLM2 (bench/results/refine.md: DP plans at 4 budgets, a neighbour on each side)
OBJECT_STORE_BYTES_PER_S = 5e9  # Ray put/get of torch tensors on one node (pickle + shared-memory copy), assumed
CALIBRATION_HIDDEN_CAP = 1024  # the measured one-layer model is at most this wide


# ---- the model's shape ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a table's cost (a dense decoder-only transformer)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelShape:
        """From a transformers config (any family with the Llama naming of its fields).

        ``config`` is read by attribute name only, so it may be a transformers config or a
        namespace of a config.json's fields (``recover.cost``): typed Any for that reason.
        """
        heads = config.num_attention_heads
        return cls(
            name=name or getattr(config, "_name_or_path", "") or config.model_type,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2"),
        )

    @property
    def geometry(self) -> ComponentGeometry:
        layer = LayerGeometry(self.heads, self.kv_heads, self.head_dim, self.intermediate)
        return ComponentGeometry(layer, self.hidden, self.qkv_bias, False, False)

    @property
    def block_params(self) -> int:
        return self.geometry.params_at("attn", 0.0) + self.geometry.params_at("mlp", 0.0) + 2 * self.hidden

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def total_params(self) -> int:
        embeddings = self.hidden * self.vocab
        return self.layers * self.block_params + embeddings + (0 if self.tied_embeddings else self.head_params) + self.hidden


# Public architecture numbers (config.json of the released checkpoints), for planning on paper.
SHAPES = {
    shape.name: shape
    for shape in (
        ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True),
        ModelShape("gemma3-270m", 18, 640, 4, 1, 256, 2048, 262144, tied_embeddings=True),
    )
}


def distinct_cuts_per_layer(shape: ModelShape, rate_grid: Sequence[float], mode: str, channel_multiple: int) -> int:
    """Distinct non-empty cuts of one layer: cells that are really measured (as ``exact.distinct_cuts``)."""
    g = shape.geometry
    full_attn = attention_shape_for_rate(g.geometry, g.hidden, 0.0, g.qkv_bias, g.o_bias)
    attn = [attention_shape_for_rate(g.geometry, g.hidden, r, g.qkv_bias, g.o_bias) for r in rate_grid[1:]]
    mlp = [channels_for_rate(shape.intermediate, r, channel_multiple) for r in rate_grid[1:]]
    if mode == "block":
        return len({(a, m) for a, m in zip(attn, mlp)} - {(full_attn, shape.intermediate)})
    return len(set(attn) - {full_attn}) + len(set(mlp) - {shape.intermediate})


# ---- what a device costs ------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceProfile:
    """Prices of the work on one device in one dtype."""

    name: str  # e.g. "cpu float32", "NVIDIA H200 bfloat16"
    block_flops: float  # FLOP/s achieved by transformer blocks
    head_flops: float  # FLOP/s achieved by the LM head with its log-softmax
    bandwidth: float  # device memory bytes/s (the softmax over the vocabulary reads and writes logits)
    host_link: float  # host -> device bytes/s (streamed blocks, block inputs)
    memory: float  # device memory bytes (0: unknown/host)
    basis: str  # where the numbers come from
    kind: str = "cuda"  # device type: on "cpu" attention materialises its T x T scores, CUDA kernels do not


# H200 SXM: 989 TFLOP/s dense bf16 (1979 with sparsity), 141 GB HBM3e at 4.8 TB/s, PCIe Gen5 x16
# to the host (64 GB/s per direction on paper, ~50 in practice). Utilisation is an assumption:
# large bf16 GEMMs reach 60-75% of peak; a whole transformer block with attention, norms and
# small kernels less, so 50% for blocks and 60% for the LM head's single large GEMM.
SPEC_PROFILES = {
    "h200": DeviceProfile(
        "NVIDIA H200 bfloat16 (spec sheet)",
        0.50 * 989e12,
        0.60 * 989e12,
        4.8e12,
        50e9,
        141e9,
        "spec sheet: 989 TFLOP/s dense bf16 x 50% (blocks) / 60% (LM head), 4.8 TB/s HBM3e, 141 GB, ~50 GB/s PCIe Gen5",
    ),
    "h100": DeviceProfile(
        "NVIDIA H100 SXM bfloat16 (spec sheet)",
        0.50 * 989e12,
        0.60 * 989e12,
        3.35e12,
        50e9,
        80e9,
        "spec sheet: 989 TFLOP/s dense bf16 x 50% / 60%, 3.35 TB/s HBM3, 80 GB, ~50 GB/s PCIe Gen5",
    ),
    "a100": DeviceProfile(
        "NVIDIA A100 SXM bfloat16 (spec sheet)",
        0.50 * 312e12,
        0.60 * 312e12,
        2.0e12,
        25e9,
        80e9,
        "spec sheet: 312 TFLOP/s dense bf16 x 50% / 60%, 2.0 TB/s HBM2e, 80 GB, ~25 GB/s PCIe Gen4",
    ),
}


def calibration_shape(shape: ModelShape) -> ModelShape:
    """The shape the calibration measures: the target's, narrowed to at most CALIBRATION_HIDDEN_CAP."""
    if shape.hidden <= CALIBRATION_HIDDEN_CAP:
        return replace(shape, layers=1, vocab=min(shape.vocab, 65536))
    scale = CALIBRATION_HIDDEN_CAP / shape.hidden
    heads = max(1, round(shape.heads * scale))
    kv = max(1, min(heads, round(shape.kv_heads * scale)))
    heads -= heads % kv
    return replace(
        shape,
        layers=1,
        hidden=CALIBRATION_HIDDEN_CAP,
        heads=heads,
        kv_heads=kv,
        intermediate=int(shape.intermediate * scale),
        vocab=min(shape.vocab, 65536),
    )


def block_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Matmul FLOPs of one block per token, causal attention included."""
    return 2.0 * shape.block_params + 2.0 * seq_len * shape.heads * shape.head_dim


def head_flops_per_token(shape: ModelShape) -> float:
    return 2.0 * shape.head_params


# Nominal float32 FLOP/s per torch thread on a CPU, from fisher builds of SmolLM2-135M on 2-core
# machines of the kind CI runs on: the gradient pass ran at 36-63 GFLOP/s a thread with other work
# beside it, and at 60-100 on a quiet one (a clean CI run: a 4x128 build in 4.2 s that 40 priced at
# 10.5 s, 2.5x, past the 2x issue 22 allows). 60 sits in the middle: within 2x of both ends, and of
# lm-eval scoring the offline task on a quiet machine (bench/bench_expected.py).
NOMINAL_BLOCK_FLOPS_PER_THREAD = 60e9  # transformer blocks
NOMINAL_HEAD_FLOPS_PER_THREAD = 60e9  # the LM head with its log-softmax
NOMINAL_BANDWIDTH = 5e9  # nominal: host memory bytes/s
LOAD_BYTES_PER_S = 150e6  # nominal: reading a safetensors folder and building the model
LOAD_FIXED_S = 2.0  # nominal: tokenizer, config, model construction
NOMINAL_BASIS = "a nominal CPU speed (no speed of this machine kept yet: Setup's Estimate measures it)"


def nominal_profile(threads: int) -> DeviceProfile:
    """Prices for a CPU nobody has measured: nominal rates per thread, times ``threads``."""
    return DeviceProfile(
        name="cpu float32", block_flops=NOMINAL_BLOCK_FLOPS_PER_THREAD * threads, head_flops=NOMINAL_HEAD_FLOPS_PER_THREAD * threads,
        bandwidth=NOMINAL_BANDWIDTH, host_link=NOMINAL_BANDWIDTH, memory=0.0, basis=NOMINAL_BASIS, kind="cpu",
    )  # fmt: skip


def folder_load_seconds(folder: Path | None, params: int) -> float:
    """Loading a saved model at nominal prices: its safetensors files, or ``4 x params`` bytes when none are there."""
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder is not None and folder.is_dir() else 0
    return LOAD_FIXED_S + (size or 4 * params) / LOAD_BYTES_PER_S


def nominal_for(placement: Placement) -> DeviceProfile | None:
    """The nominal profile of this CPU at torch's thread count; None on an accelerator (no honest prior)."""
    import torch

    return nominal_profile(torch.get_num_threads()) if placement.device.type == "cpu" else None


def scoring_profile(placement: Placement, shape: ModelShape, measure: bool) -> DeviceProfile | None:
    """This machine's prices at the shape lm-eval's scoring runs (``TASK_BATCH`` requests of
    ``TASK_TOKENS``): a profile measured on a training batch of 2 x 32 tokens priced it 2.8x
    too slow. None when not cached and ``measure`` is False (measuring takes a few seconds, once)."""
    from gap_engine.evaluate.tasks import TASK_BATCH, TASK_TOKENS

    return measured_profile(placement, shape, seq_len=TASK_TOKENS, batch=TASK_BATCH, measure=measure)


def _profile_path(key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "costmodel" / f"profile-{digest}.json"


def measured_profile(
    placement: Placement, shape: ModelShape, seq_len: int = 256, batch: int = 2, refresh: bool = False, measure: bool = True
) -> DeviceProfile | None:
    """This machine's speed on a one-layer model of ``shape`` (narrowed), measured once and cached.

    Args:
        placement: a ``device.Placement`` (device and dtype to measure).
        shape: the target model's shape.
        seq_len, batch: tokens per window and windows per call of the measurement.
        refresh: measure again even when a cached profile exists.
        measure: False returns None instead of measuring when nothing is cached.
    """
    import torch

    calib = calibration_shape(shape)
    key = {
        "device": str(placement.device),
        "dtype": str(placement.dtype),
        "shape": asdict(calib),
        "seq_len": seq_len,
        "batch": batch,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(placement.device) if placement.device.type == "cuda" else None,
    }
    path = _profile_path(key)
    if path.is_file() and not refresh:
        try:
            return DeviceProfile(**json.loads(path.read_text())["profile"])
        except (OSError, ValueError, TypeError, KeyError):
            log.warning("ignoring an unreadable cost-model profile %s", path)
    if not measure:
        return None
    busy = busy_cpu(placement)  # read before measuring: the measurement's own threads add to the load
    profile = _measure(placement, calib, seq_len, batch)
    if busy is not None:  # right for this estimate, wrong to keep: it would price every later one
        return replace(profile, basis=f"{profile.basis}; not kept: this machine was busy ({busy})")
    atomic_write_json(path, {"key": key, "profile": asdict(profile)})
    return profile


def busy_cpu(placement: Placement, window: float = 0.5) -> str | None:
    """Why a CPU measurement now would read this machine slow, or None when it is quiet enough.

    At least half the cores in use over the last ``window`` seconds (sampled: the 1-minute load average also
    counted work that had just ended, like the app loading the model): busy two-core readings were 1.25-36
    GFLOP/s (quiet: 60-100), and one, cached, priced a 2-minute recovery at 14 minutes. Not for a GPU.
    """
    import psutil

    if placement.device.type != "cpu":
        return None
    cores = psutil.cpu_count() or 1
    in_use = psutil.cpu_percent(interval=window) / 100 * cores  # every process, this one's other threads too
    return f"{in_use:.1f} of {cores} cores in use" if in_use >= max(1.0, cores / 2) else None


def _time(fn: Callable[[], object], device: torch.device, repeats: int = 3, min_seconds: float = 0.3, max_repeats: int = 30) -> float:
    """The best of at least ``repeats`` calls, repeated until ``min_seconds`` went by: one layer's
    call takes milliseconds, and on a shared machine the best of three such calls once read 14
    GFLOP/s where a minute earlier it read 69 (the profile is cached, so one bad reading lasts)."""
    from gap_engine.core.device import synchronize

    fn()  # warm-up
    synchronize(device)
    best, spent, done = math.inf, 0.0, 0
    while done < repeats or (spent < min_seconds and done < max_repeats):
        started = time.perf_counter()
        fn()
        synchronize(device)
        took = time.perf_counter() - started
        best, spent, done = min(best, took), spent + took, done + 1
    return best


def _measure(placement: Placement, calib: ModelShape, seq_len: int, batch: int) -> DeviceProfile:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers import LlamaConfig, LlamaModel

    device, dtype = placement.device, placement.dtype
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=calib.hidden,
        intermediate_size=calib.intermediate,
        num_hidden_layers=1,
        num_attention_heads=calib.heads,
        num_key_value_heads=calib.kv_heads,
        head_dim=calib.head_dim,
        max_position_embeddings=max(seq_len, 512),
    )
    torch.manual_seed(0)
    block: nn.Module = LlamaModel(config)  # as a Module: transformers' typing of PreTrainedModel.to is off
    block = block.to(device=device, dtype=dtype).eval()
    embeds = torch.randn(batch, seq_len, calib.hidden, device=device, dtype=dtype)
    head = torch.nn.Linear(calib.hidden, calib.vocab, bias=False, device=device, dtype=dtype)
    tokens = batch * seq_len
    with torch.inference_mode():
        block_seconds = _time(lambda: block(inputs_embeds=embeds, use_cache=False), device)
        head_seconds = _time(lambda: F.log_softmax(head(embeds).float(), dim=-1), device)
        big = torch.empty(32 << 20, dtype=torch.float32, device=device)  # 128 MiB
        copy_seconds = _time(lambda: big.clone(), device)
        host = torch.empty(32 << 20, dtype=torch.float32, pin_memory=device.type == "cuda")
        link_seconds = _time(lambda: host.to(device), device) if device.type != "cpu" else copy_seconds
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return DeviceProfile(
        name=f"{device} {str(dtype).removeprefix('torch.')}",
        block_flops=tokens * block_flops_per_token(calib, seq_len) / block_seconds,
        head_flops=tokens * head_flops_per_token(calib) / head_seconds,
        bandwidth=2 * big.numel() * 4 / copy_seconds,
        host_link=host.numel() * 4 / link_seconds,
        memory=float(memory),
        kind=device.type,
        basis=f"measured on this machine {time.strftime('%Y-%m-%d %H:%M')} (one {calib.hidden}-wide layer, {batch} x {seq_len} tokens)",
    )


# ---- the prediction -------------------------------------------------------------------------------
@dataclass
class BuildEstimate:
    """Predicted time and peak memory of one table build."""

    model: str  # the shape's name
    estimator: str  # exact | fisher | taylor | refine
    device: str  # the profile's name
    basis: str  # where the prices come from
    workers: int  # Ray workers (1: one process)
    stream: bool  # blocks streamed from the host
    cells: int  # distinct cells measured (exact, refine)
    seconds: float  # predicted wall time
    parts: dict[str, float]  # seconds per part: importance, dense pass, cells, transfers, ...
    device_bytes: float  # peak device memory of the busiest process
    host_bytes: float  # peak host memory of the driver
    device_memory: float  # the device's memory (0: unknown)
    notes: list[str]  # assumptions worth reading

    @property
    def fits(self) -> bool | None:
        return None if not self.device_memory else self.device_bytes <= self.device_memory

    def lines(self) -> list[str]:
        """A short human report (the CLI prints it; the app shows it before Build)."""
        parts = ", ".join(f"{name} {_duration(s)}" for name, s in self.parts.items() if s > 0)
        where = f"{self.device}" + (", streamed" if self.stream else "") + (f", {self.workers} Ray workers" if self.workers > 1 else "")
        out = [
            f"predicted {self.estimator} table of {self.model} on {where}: {_duration(self.seconds)} ({parts})",
            f"peak memory: {_bytes(self.device_bytes)} on the device"
            + (f" of {_bytes(self.device_memory)}" if self.device_memory else "")
            + f", {_bytes(self.host_bytes)} on the host"
            + (f"; {self.cells:,} distinct cells" if self.cells else ""),
        ]
        if self.fits is False:
            out.append("does not fit the device: add --stream (blocks from the host), fewer/shorter windows, or --ray workers")
        out.append(f"basis: {self.basis}")
        return out + [f"assumes: {note}" for note in self.notes]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"fits": self.fits}


def stage_seconds(estimate: BuildEstimate) -> dict[str, float]:
    """The estimate's parts as the table job's stages (``progress`` names), for its time-left
    before this machine has built a comparable table (transfers and shipping go to the
    stage that moves the data)."""
    parts = estimate.parts
    moving = parts.get("transfers", 0.0) + parts.get("shipping", 0.0)
    stages = {SCORE_UNITS: parts.get("importance", 0.0)}
    if "dense pass" in parts:
        stages[DENSE_PASS] = parts["dense pass"]
        stages[CELLS] = parts.get("cells", 0.0) + moving
    if "gradient pass" in parts:
        stages[GRADIENT_PASS] = parts["gradient pass"] + (0.0 if "dense pass" in parts else moving)
    return stages


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _bytes(value: float) -> str:
    return f"{value / 1e9:.1f} GB" if value >= 1e8 else f"{value / 1e6:.0f} MB"


def layer_cells(shape: ModelShape, spec: TableSpec) -> list[int]:
    """Distinct cells per layer (the same for every layer of a dense model)."""
    return [distinct_cuts_per_layer(shape, spec.rate_grid, spec.mode, spec.channel_multiple)] * shape.layers


def _seconds_per_token(shape: ModelShape, profile: DeviceProfile, seq_len: int) -> tuple[float, float]:
    """(one block, the LM head with its softmax) seconds per token."""
    block = block_flops_per_token(shape, seq_len) / profile.block_flops
    head = head_flops_per_token(shape) / profile.head_flops
    if profile.basis.startswith("spec"):  # measured head rates include the softmax; spec sheets do not
        head += shape.vocab * 12 / profile.bandwidth  # read logits, write float32 log-probabilities, reduce
    return block, head


def estimate_build(
    shape: ModelShape, spec: TableSpec, profile: DeviceProfile, dtype_bytes: int, stream: bool = False, workers: int = 1
) -> BuildEstimate:
    """Predicted time and peak memory of building ``spec``'s table for ``shape``.

    Args:
        shape: the model's dimensions.
        spec: a ``tables.TableSpec`` (estimator, grid, mode, windows); ``refine`` is accepted
            as an estimator name even where the spec class does not know it yet.
        profile: prices of the device (``measured_profile`` or ``SPEC_PROFILES``).
        dtype_bytes: bytes per weight and activation (4 float32, 2 bf16/fp16).
        stream: blocks on the host, one at a time on the device.
        workers: Ray workers measuring cells (1: one process).
    """
    from gap_engine.tables.distributed import layer_ranges

    n, t = spec.windows.n_samples, spec.windows.seq_len
    tokens, L = n * t, shape.layers
    block_t, head_t = _seconds_per_token(shape, profile, t)
    forward = tokens * (L * block_t + head_t)
    criterion_passes = {"magnitude": 0.0, "taylor": 3.0}.get(spec.criterion, 1.0)
    parts = {"importance": criterion_passes * forward}
    notes = ["no overlap of transfers with compute", "backward = 2 x forward FLOPs"]
    per_layer = layer_cells(shape, spec)
    cells, cell_costs = 0, dict[int, float]()
    if spec.estimator in ("exact", "refine"):
        measured = (
            per_layer if spec.estimator == "exact" else [min(c, REFINE_CELLS * (2 if spec.mode == "split" else 1)) for c in per_layer]
        )
        if spec.estimator == "refine":
            notes.append(f"refine = a fisher pass + {REFINE_CELLS} measured cells per component")
        cells = sum(measured)
        cell_costs = {i: c * tokens * ((L - i) * block_t + head_t) for i, c in enumerate(measured) if c}
        parts["dense pass"] = forward
    if spec.estimator in ("fisher", "taylor", "refine"):
        # A streamed backward pass runs each block forward a second time before differentiating it.
        parts["gradient pass"] = ((5.0 if spec.estimator != "taylor" else 3.0) + (1.0 if stream else 0.0)) * forward
    ranges = layer_ranges(cell_costs, workers) if cell_costs else []
    parts["cells"] = max((sum(cell_costs[i] for i in run) for run in ranges), default=0.0)
    state_bytes = tokens * shape.hidden * dtype_bytes  # one (N, T, d) hidden state
    block_bytes = shape.block_params * dtype_bytes
    per_group = 0
    if stream:
        free = (
            profile.memory
            - (shape.total_params - (L - 1) * shape.block_params) * dtype_bytes
            - _working_bytes(shape, spec, dtype_bytes, profile.kind)
        )
        budget = free / 2 if profile.memory else STREAM_GROUP_BYTES
        moves, per_group = _stream_moves(per_layer if spec.estimator == "exact" else [0] * L, L, state_bytes, budget)
        passes = (criterion_passes > 0) + ("dense pass" in parts)
        # Blocks cross once per pass and per group sweep; each cell takes its dense input over once;
        # the block-by-block passes send every block's output back to the host and fetch it again.
        sweeps = (moves * block_bytes + cells * state_bytes) / (len(ranges) if workers > 1 and ranges else 1)  # one link per worker
        # A streamed gradient pass: every block crosses twice (forward, then backward) and each
        # block's input, output and the gradient travelling down cross about five times.
        gradient = L * (2 * block_bytes + 5 * state_bytes) if "gradient pass" in parts else 0.0
        parts["transfers"] = (passes * L * (block_bytes + 2 * state_bytes) + sweeps + gradient) / profile.host_link
        notes.append(f"streamed cells in groups of {per_group} (their states stay on the device)")
    if workers > 1 and ranges:
        # Workers fetch in parallel; the one owning the earliest layers fetches the most blocks.
        shipped = (L - min(cell_costs)) * block_bytes + len(ranges[0]) * state_bytes
        parts["shipping"] = shipped / OBJECT_STORE_BYTES_PER_S
        notes.append(f"Ray objects move at {OBJECT_STORE_BYTES_PER_S / 1e9:.0f} GB/s (one node; a network between nodes is slower)")
    in_flight = per_group * state_bytes if stream and cells else 0
    device_bytes, host_bytes = _memory(shape, spec, dtype_bytes, stream, workers, ranges, in_flight, profile.kind)
    if stream and spec.estimator in ("fisher", "taylor", "refine"):
        notes.append("the gradient pass streams too: one block on the device, recomputed for its backward")
    return BuildEstimate(
        model=shape.name,
        estimator=spec.estimator,
        device=profile.name,
        basis=profile.basis,
        workers=max(1, len(ranges)) if workers > 1 else 1,
        stream=stream,
        cells=cells,
        seconds=sum(parts.values()),
        parts=parts,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        device_memory=profile.memory,
        notes=notes,
    )


def _stream_moves(per_layer: list[int], layers: int, state_bytes: int, budget: float) -> tuple[int, int]:
    """(block moves of the streamed cell groups, cells per group), as ``tables.streaming`` groups them."""
    per_group = max(1, int(budget // max(state_bytes, 1)))
    ordered = [i for i, c in enumerate(per_layer) for _ in range(c)]
    return sum(layers - ordered[g] for g in range(0, len(ordered), per_group)), per_group


def _working_bytes(shape: ModelShape, spec: TableSpec, dtype_bytes: int, kind: str, gradients: bool = False) -> float:
    """One batch's working set: the widest activations and the float32 logits (every block's
    activations when a backward pass follows)."""
    b, t, d = spec.windows.batch_size, spec.windows.seq_len, shape.hidden
    logits = b * t * shape.vocab * (dtype_bytes + 8)  # model-dtype logits, their float32 copy and log-probabilities
    activations = b * t * (2 * shape.intermediate + 4 * d) * dtype_bytes
    if kind == "cpu":  # the CPU's attention kernels hold the T x T scores; flash kernels on CUDA do not
        activations += b * shape.heads * t * t * dtype_bytes
    return logits + (shape.layers if gradients else 1) * activations


def _memory(
    shape: ModelShape, spec: TableSpec, dtype_bytes: int, stream: bool, workers: int, ranges: list[list[int]], in_flight: float, kind: str
) -> tuple[float, float]:
    """(peak device bytes of the busiest process, peak host bytes of the driver); ``in_flight``:
    the streamed cells' states held on the device."""
    n, t = spec.windows.n_samples, spec.windows.seq_len
    L, d = shape.layers, shape.hidden
    weights = shape.total_params * dtype_bytes
    block = shape.block_params * dtype_bytes
    state = n * t * d * dtype_bytes
    working = _working_bytes(shape, spec, dtype_bytes, kind)
    # A gradient pass (fisher, taylor, the first half of refine) holds the whole model and every
    # block's activations on the device; streamed, one block and its activations (twice: forward
    # and backward), while the host keeps every block's input and the gradient travelling down.
    gradient_pass, gradient_host = 0.0, 0.0
    if spec.estimator != "exact" and stream:
        gradient_pass = weights - (L - 1) * block + 2 * working + 2 * state
        gradient_host = weights + (L + 2) * state
    elif spec.estimator != "exact":
        gradient_pass = weights + _working_bytes(shape, spec, dtype_bytes, kind, gradients=True)
    if spec.estimator not in ("exact", "refine"):
        return float(gradient_pass), float(gradient_host)
    stored = (L + 1) * state  # dense block inputs and final states
    if spec.objective == "kl" and n * t * shape.vocab * 4 <= MAX_STORED_LOGPROB_BYTES:
        stored += n * t * shape.vocab * 4
    non_block = weights - L * block
    device: float
    host: float
    if stream:
        device, host = non_block + block + working + in_flight + state, weights + stored
    else:
        device, host = weights + stored + working, 0.0
    if workers > 1 and ranges:
        first = min(run[0] for run in ranges)
        own_inputs = (len(ranges[0]) + 1) * state
        device = non_block + working + (block + in_flight + state if stream else (L - first) * block + own_inputs)
    return float(max(device, gradient_pass)), float(max(host, gradient_host))


def model_shape(name_or_path: str) -> ModelShape:
    """The shape of a named shape (``SHAPES``), a built-in, a model folder or hub id, read from its
    config where one is on disk (no weights loaded), else from the loaded model."""
    if name_or_path in SHAPES:
        return SHAPES[name_or_path]

    from transformers import AutoConfig

    from gap_engine.model.checkpoint import is_pruned_checkpoint
    from gap_engine.model.loading import BUILTIN_MODELS, CONVERTED_MARKER, load_model
    from gap_engine.model.remote_code import refuse_foreign_code

    folder = cache_root() / "models" / name_or_path if name_or_path in BUILTIN_MODELS else Path(name_or_path).expanduser()
    if (folder / "config.json").is_file() and (name_or_path not in BUILTIN_MODELS or (folder / CONVERTED_MARKER).is_file()):
        refuse_foreign_code(folder, is_pruned_checkpoint(folder))
        return ModelShape.from_config(AutoConfig.from_pretrained(str(folder), trust_remote_code=False), name_or_path)
    return ModelShape.from_config(load_model(name_or_path).model.config, name_or_path)


def predict_build(
    model: str, spec: TableSpec, device: DeviceSpec, workers: int = 1, profile: str | None = None, measure: bool = True
) -> BuildEstimate | None:
    """The predicted time and memory of building ``spec``'s table for ``model``: what `gap table
    --dry-run` prints and the explorer's Setup shows before Build (one assembly for both).

    Args:
        model: a built-in name, folder, .gguf file or hub id (only its config is read).
        spec: the TableSpec to price.
        device: the DeviceSpec the build would run on.
        workers: Ray workers sharing the exact cells (1 without Ray).
        profile: price the work on a spec sheet (a key of SPEC_PROFILES) instead of this machine.
        measure: False returns None instead of measuring this machine when nothing is cached.
    """
    from gap_engine.core.device import resolve
    from gap_engine.core.errors import TableError

    if profile is not None and profile not in SPEC_PROFILES:
        raise TableError(f"unknown --profile '{profile}'; choose one of {', '.join(SPEC_PROFILES)}")
    if workers < 1:
        raise TableError(f"--ray-workers must be at least 1, got {workers}")
    placement = resolve(device)
    shape = model_shape(model)
    if profile is not None:
        return estimate_build(shape, spec, SPEC_PROFILES[profile], 2, stream=placement.stream, workers=workers)
    windows = spec.windows
    measured = measured_profile(placement, shape, seq_len=min(windows.seq_len, 512), batch=min(windows.batch_size, 4), measure=measure)
    if measured is None:
        return None
    return estimate_build(shape, spec, measured, placement.dtype.itemsize, stream=placement.stream, workers=workers)
