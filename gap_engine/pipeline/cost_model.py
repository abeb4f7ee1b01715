"""What a job will take before it starts, as an honest order of magnitude (once it runs, its own progress gives
the time left: ``pipeline.jobs``); `gap table --dry-run` adds a table build's peak memory.

Work is counted from the model's shape (nothing is loaded) in forward passes: 2 x parameters FLOPs a token, causal
attention 2 x T x heads x head_dim more, a backward pass two forwards, a fixed cost per block call; an exact table runs
blocks i..L-1 and the LM head once per distinct cell of layer i. A `DeviceProfile` prices it: measured on this machine
when asked (Setup's Estimate, the dry run), a spec sheet (``--profile``) or nominal CPU prices per torch thread; an
accelerator nobody measured gets no prediction. What finished jobs of the same kind took here corrects the next
prediction (``pipeline.learned``: their median actual / predicted, scaled by the load now). ``bench/bench_expected.py``
checks both against real jobs under this machine's load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from gap_engine.core import progress as stage
from gap_engine.core.config import WindowSpec, obs_window_count
from gap_engine.core.device import DeviceSpec, Placement, placement_of, resolve, synchronize
from gap_engine.core.errors import TableError
from gap_engine.core.fsutil import atomic_write_json, cache_root
from gap_engine.evaluate.metrics import THROUGHPUT_REPEATS, EvalSettings
from gap_engine.model.adapters import LayerGeometry, qkv_bias_by_default
from gap_engine.model.checkpoint import is_pruned_checkpoint
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.loading import BUILTIN_MODELS, CONVERTED_MARKER, load_model
from gap_engine.model.remote_code import refuse_foreign_code
from gap_engine.model.units import ComponentGeometry, attention_shape_for_rate, channels_for_rate
from gap_engine.pipeline import learned
from gap_engine.plan.allocator_registry import ALLOCATORS
from gap_engine.prune.criteria import CRITERIA
from gap_engine.prune.obs import channel_greedy_bytes
from gap_engine.recover.methods import RECOVERY_METHODS
from gap_engine.recover.teacher_text import BATCH, TeacherTextSpec, uncached_tokens
from gap_engine.recover.train import PROBE_FACTORS, PROBE_STEPS
from gap_engine.tables.artefact import TableSpec, table_components
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.exact import MAX_STORED_LOGPROB_BYTES
from gap_engine.tables.streaming import STREAM_GROUP_BYTES

if TYPE_CHECKING:
    from gap_engine.recover.settings import RecoverySettings

log = logging.getLogger(__name__)

# Nominal CPU speed: fisher builds of SmolLM2-135M on 2-core machines ran at 36-63 GFLOP/s a thread
# beside other work and 60-100 on a quiet one; 60 is within 2x of both, and of lm-eval scoring.
NOMINAL_FLOPS_PER_THREAD = 60e9
NOMINAL_BANDWIDTH = 5e9  # host memory bytes/s
NOMINAL_BASIS = "a nominal CPU speed (no speed of this machine kept yet: Setup's Estimate measures it)"
CALL_SECONDS_PER_BLOCK = 4e-4  # nominal: Python and kernel launches of one block call
LOAD_BYTES_PER_S, LOAD_FIXED_S = 150e6, 2.0  # nominal: reading safetensors and building the model; tokenizer and config
DEQUANT_S_PER_PARAM = 2.5e-7  # nominal: a built-in's first use de-quantizes its GGUF (20-60 s)
READ_TEXT_S = 3.0  # nominal: reading and tokenizing a built-in text
SAVE_BYTES_PER_S = 100e6  # nominal: writing a checkpoint
Z_DRAW_S_PER_VALUE = 8e-9  # nominal: one ZO direction value drawn by one CPU thread (torch's normal sampler)
# The offline task's 4 requests per example, 88 tokens each (its 2,000 requests, SmolLM2's tokenizer); lm-eval's first import.
TASK_CHOICES, TASK_TOKENS, TASK_IMPORT_S = 4, 88, 6.0
# Teacher text a token at a time vs a dense window forward: 64 rows 10.5 ms a token, a 128-token window 8.2 ms.
GENERATION_FACTOR = 1.3
# Its nucleus sampling on one CPU thread, per vocabulary value of a row (recover.teacher_text.nucleus_sample): the
# softmax and its 1,024 most likely tokens, then a whole sort of the row where they hold less than top-p (7 ms for
# 49,152 values). Priced for every row: an untrained model's flat distribution sorts all of them (1.5 s a step of
# 64 rows for a 3M-parameter one), SmolLM2-135M about a third (the price is then up to twice its time).
NUCLEUS_TOP_S_PER_VALUE, NUCLEUS_SORT_S_PER_VALUE = 8e-9, 1.4e-7
# Choosing every cell's units in Python (``tables.cells.unit_cuts``), whatever the estimator and the text: 0.57 ms a
# cell measured on a quiet 2-core machine (SmolLM2's 960 cells, 0.55 s), priced 2x as the nominal FLOP rates are.
# Without it a small build's time taught the learned factor 1.5-1.9x too much for a larger one (bench_expected).
CELL_BOOKKEEPING_S = 1.2e-3
REFINE_CELLS = 4  # measured cells per component assumed for refine: 3.8 on SmolLM2 (bench/results/refine.md)
CALIBRATION_HIDDEN_CAP = 1024  # the measured one-layer model is at most this wide
PREDICTED = "predicted by the cost model"  # how every basis starts (the pages label the time a prediction)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a job's cost (a dense decoder-only transformer)."""

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
        """From a transformers config or a config.json's dict (Llama's names; a model type's defaults from its adapter)."""

        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

        heads, hidden = get("num_attention_heads"), get("hidden_size")
        return cls(
            name or get("_name_or_path") or get("model_type") or "", get("num_hidden_layers"), hidden, heads,
            get("num_key_value_heads") or heads, get("head_dim") or hidden // heads, get("intermediate_size"),
            get("vocab_size"), bool(get("tie_word_embeddings")), bool(get("attention_bias") or qkv_bias_by_default(get("model_type"))),
        )  # fmt: skip

    @property
    def geometry(self) -> ComponentGeometry:
        layer = LayerGeometry(self.heads, self.kv_heads, self.head_dim, self.intermediate)
        return ComponentGeometry(layer, self.hidden, self.qkv_bias, o_bias=False, mlp_bias=False)

    @property
    def block_params(self) -> int:
        return self.geometry.params_at("attn", 0.0) + self.geometry.params_at("mlp", 0.0) + 2 * self.hidden

    @property
    def total_params(self) -> int:
        return self.layers * self.block_params + self.hidden * self.vocab * (1 if self.tied_embeddings else 2) + self.hidden

    def flops(self, seq_len: int) -> float:
        """Matmul FLOPs of one block per token, causal attention included."""
        return 2.0 * self.block_params + 2.0 * seq_len * self.heads * self.head_dim


# Public architecture numbers (config.json of the released checkpoints), for planning on paper.
_PUBLISHED = (
    ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied_embeddings=True),
    ModelShape("gemma3-270m", 18, 640, 4, 1, 256, 2048, 262144, tied_embeddings=True),
)
SHAPES = {shape.name: shape for shape in _PUBLISHED}


def model_shape(name_or_path: str) -> ModelShape:
    """A named shape (``SHAPES``), else the model's config.json on disk (no weights read), else the loaded model's."""
    if name_or_path in SHAPES:
        return SHAPES[name_or_path]
    from transformers import AutoConfig

    folder = cache_root() / "models" / name_or_path if name_or_path in BUILTIN_MODELS else Path(name_or_path).expanduser()
    if (folder / "config.json").is_file() and (name_or_path not in BUILTIN_MODELS or (folder / CONVERTED_MARKER).is_file()):
        refuse_foreign_code(folder, is_pruned_checkpoint(folder))
        return ModelShape.from_config(AutoConfig.from_pretrained(str(folder), trust_remote_code=False), name_or_path)
    return ModelShape.from_config(load_model(name_or_path).model.config, name_or_path)


def checkpoint_shapes(folder: str | Path) -> tuple[ModelShape, list[ModelShape]] | None:
    """(the dense shape, each block's shape at its own widths) from a checkpoint's config.json; None: unreadable."""
    try:
        config = json.loads((Path(folder).expanduser() / "config.json").read_text(encoding="utf-8"))
        dense, per_layer = ModelShape.from_config(config), config.get("per_layer_config") or {}
        widths = [per_layer.get(str(i)) or {} for i in range(dense.layers)]
        return dense, [
            replace(dense, heads=int(w.get("num_attention_heads", dense.heads)), kv_heads=int(w.get("num_key_value_heads", dense.kv_heads)),
                    intermediate=int(w.get("intermediate_size", dense.intermediate)))
            for w in widths
        ]  # fmt: skip
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def distinct_cuts_per_layer(shape: ModelShape, rate_grid: tuple[float, ...], mode: str, channel_multiple: int) -> int:
    """Distinct non-empty cuts of one layer: the cells really measured (as ``tables.exact.distinct_cuts``)."""
    g = shape.geometry
    attn = [attention_shape_for_rate(g.geometry, g.hidden, r, g.qkv_bias, g.o_bias) for r in rate_grid]
    mlp = [channels_for_rate(shape.intermediate, r, channel_multiple) for r in rate_grid]
    if mode == "block":
        return len(set(zip(attn[1:], mlp[1:])) - {(attn[0], shape.intermediate)})
    return len(set(attn[1:]) - {attn[0]}) + len(set(mlp[1:]) - {shape.intermediate})


@dataclass(frozen=True)
class DeviceProfile:
    """Prices of the work on one device in one dtype."""

    name: str  # e.g. "cpu float32", "NVIDIA H200 bfloat16"
    block_flops: float  # FLOP/s achieved by transformer blocks
    head_flops: float  # FLOP/s achieved by the LM head with its log-softmax
    memory: float  # device memory bytes (0: unknown/host)
    basis: str  # where the numbers come from
    kind: str = "cuda"  # device type: on "cpu" attention materialises its T x T scores, CUDA kernels do not


# Spec sheets: peak dense bf16 x an assumed utilisation (large GEMMs reach 60-75% of peak, a whole block
# with attention, norms and small kernels less: 50% for blocks, 60% for the LM head's one GEMM) and memory.
SPEC_PROFILES = {
    key: DeviceProfile(f"{gpu} bfloat16 (spec sheet)", 0.5e12 * tflops, 0.6e12 * tflops, gb * 1e9,
                       f"spec sheet: {tflops:g} TFLOP/s dense bf16 x 50% (blocks) / 60% (LM head), {gb:g} GB")
    for key, gpu, tflops, gb in (("h200", "NVIDIA H200", 989, 141), ("h100", "NVIDIA H100 SXM", 989, 80),
                                 ("a100", "NVIDIA A100 SXM", 312, 80))
}  # fmt: skip


def nominal_profile(threads: int) -> DeviceProfile:
    """Prices for a CPU nobody measured: nominal rates per thread, times ``threads``."""
    return DeviceProfile("cpu float32", NOMINAL_FLOPS_PER_THREAD * threads, NOMINAL_FLOPS_PER_THREAD * threads, 0.0, NOMINAL_BASIS, "cpu")


def measured_profile(placement: Placement, shape: ModelShape, seq_len=256, batch=2, refresh=False, measure=True) -> DeviceProfile | None:
    """This machine's speed on one layer of ``shape`` (at most CALIBRATION_HIDDEN_CAP wide), ``batch`` x ``seq_len`` tokens,
    measured once and cached; ``refresh``: again (a busy reading is replaced); ``measure`` False: None if nothing is cached."""
    scale = min(1.0, CALIBRATION_HIDDEN_CAP / shape.hidden)
    heads, kv = max(1, round(shape.heads * scale)), max(1, round(shape.kv_heads * scale))
    heads, kv = heads - heads % min(kv, heads), min(kv, heads)
    calib = replace(shape, layers=1, hidden=min(shape.hidden, CALIBRATION_HIDDEN_CAP), heads=heads, kv_heads=kv,
                    intermediate=int(shape.intermediate * scale), vocab=min(shape.vocab, 65536))  # fmt: skip
    gpu = torch.cuda.get_device_name(placement.device) if placement.device.type == "cuda" else None
    key = {"device": str(placement.device), "dtype": str(placement.dtype), "shape": asdict(calib), "seq_len": seq_len, "batch": batch}
    key |= {"torch": torch.__version__, "threads": torch.get_num_threads(), "gpu": gpu}
    path = cache_root() / "costmodel" / f"profile-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    if path.is_file() and not refresh:
        try:
            return DeviceProfile(**json.loads(path.read_text())["profile"])
        except (OSError, ValueError, TypeError, KeyError):
            log.warning("ignoring an unreadable cost-model profile %s", path)
    if not (measure or refresh):
        return None
    profile = _measure(placement, calib, seq_len, batch)
    atomic_write_json(path, {"key": key, "profile": asdict(profile)})
    return profile


def _best_seconds(fn: Callable[[], object], device: Any) -> float:
    """The best call after a warm-up, of 3 to 30 until 0.3 s went by (the best of 3 once read 14 GFLOP/s for a 69)."""
    times: list[float] = []
    while len(times) < 4 or (sum(times) < 0.3 and len(times) < 30):
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return min(times[1:])


def _measure(placement: Placement, calib: ModelShape, seq_len: int, batch: int) -> DeviceProfile:
    from transformers import LlamaConfig, LlamaModel

    device, dtype, c = placement.device, placement.dtype, calib
    config = LlamaConfig(
        vocab_size=256, hidden_size=c.hidden, intermediate_size=c.intermediate, num_hidden_layers=1, num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads, head_dim=c.head_dim, max_position_embeddings=max(seq_len, 512),
    )  # fmt: skip
    torch.manual_seed(0)
    block: torch.nn.Module = LlamaModel(config)  # as a Module: transformers' typing of PreTrainedModel.to is off
    block = block.to(device=device, dtype=dtype).eval()
    embeds = torch.randn(batch, seq_len, c.hidden, device=device, dtype=dtype)  # (B, T, d)
    head = torch.nn.Linear(c.hidden, c.vocab, bias=False, device=device, dtype=dtype)
    with torch.inference_mode():
        block_s = _best_seconds(lambda: block(inputs_embeds=embeds, use_cache=False), device)
        head_s = _best_seconds(lambda: F.log_softmax(head(embeds).float(), dim=-1), device)
    tokens, memory = batch * seq_len, torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    basis = f"measured on this machine {time.strftime('%Y-%m-%d %H:%M')} (one {c.hidden}-wide layer, {batch} x {seq_len} tokens)"
    flops = (tokens * c.flops(seq_len) / block_s, tokens * 2.0 * c.hidden * c.vocab / head_s)
    return DeviceProfile(f"{device} {str(dtype).removeprefix('torch.')}", *flops, float(memory), basis, device.type)


def _prices(model: str | ModelShape, placement: Placement, seq_len: int, batch: int) -> tuple[ModelShape, DeviceProfile] | None:
    """(shape, prices) before Start: this machine's cached profile (never measured here: it takes seconds), else nominal
    CPU prices; None where the shape needs the network or a load (a hub id), or on an accelerator nobody measured."""
    if isinstance(model, str) and model not in SHAPES and not (Path(model).expanduser() / "config.json").is_file():
        return None
    shape = model_shape(model) if isinstance(model, str) else model
    profile = measured_profile(placement, shape, min(seq_len, 512), min(batch, 4), measure=False)
    profile = profile or (nominal_profile(torch.get_num_threads()) if placement.device.type == "cpu" else None)
    return None if profile is None else (shape, profile)


def forward_seconds(shape: ModelShape, profile: DeviceProfile, tokens: float, seq_len: int, calls=0.0, blocks=None) -> float:
    """A forward pass over ``tokens`` in windows of ``seq_len`` in ``calls`` calls; ``blocks``: a pruned model's per layer."""
    blocks = blocks or [shape] * shape.layers
    per_token = sum(b.flops(seq_len) for b in blocks) / profile.block_flops + 2.0 * shape.hidden * shape.vocab / profile.head_flops
    return tokens * per_token + calls * len(blocks) * CALL_SECONDS_PER_BLOCK


def scoring_seconds(examples: int, forward: Callable[[float, int], float]) -> float:
    """Scoring ``examples`` examples of the offline task, given ``forward(tokens, seq_len)`` of one call."""
    return examples * forward(TASK_CHOICES * TASK_TOKENS, TASK_TOKENS)


def load_seconds(model: str, params: int) -> float:
    """Loading ``model`` (a built-in de-quantizes its GGUF on first use): its safetensors, else 4 x params bytes."""
    folder = cache_root() / "models" / model if model in BUILTIN_MODELS else Path(model).expanduser()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0
    dequant = params * DEQUANT_S_PER_PARAM if model in BUILTIN_MODELS and not (folder / CONVERTED_MARKER).is_file() else 0.0
    return LOAD_FIXED_S + (size or 4 * params) / LOAD_BYTES_PER_S + dequant


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds per stage of one job (its ETA until its own progress takes over)."""

    seconds: dict[str, float]  # stage -> predicted seconds
    basis: str  # where the prices come from, in a few words
    step_s: float = 0.0  # a recovery: one training step
    tasks_s: float = 0.0  # of the total: scoring lm-eval tasks
    text_s: float = 0.0  # of the total: writing teacher text the cache lacks
    judge_s: float = 0.0  # of the total: judging snapshots (``judgements`` of them)
    judgements: int = 0
    kind: str = ""  # the kind of job: its finished runs here correct the next prediction (``learned``)
    prices: str = ""  # what priced it (the device profile's basis)
    correction: learned.Learned | None = None  # the correction applied (None: no finished run of its kind yet)

    @property
    def total(self) -> float:
        return float(sum(self.seconds.values()))

    @property
    def where(self) -> str:
        """What the time rests on, in a few words: "learned from 5 runs on this machine" or "not yet measured here"."""
        return self.correction.text if self.correction else "not yet measured here"

    def pending(self) -> learned.Pending:
        """The job about to start, to be recorded against the cost model's own seconds when it finishes."""
        return learned.Pending(self.kind, self.total / (self.correction.factor if self.correction else 1.0), self.prices)


def with_learned_factor(prediction: Prediction) -> Prediction:
    """``prediction`` times the factor finished jobs of its kind taught (``learned.factor_for``), saying so."""
    found = learned.factor_for(prediction.kind, prediction.prices)
    if found is None:
        return prediction
    f, p = found.factor, prediction
    return replace(
        p, seconds={name: seconds * f for name, seconds in p.seconds.items()}, step_s=p.step_s * f, tasks_s=p.tasks_s * f,
        text_s=p.text_s * f, judge_s=p.judge_s * f, correction=found, basis=f"{p.basis}; x{f:.2g} for this machine's speed and load now",
    )  # fmt: skip


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
    parts: dict[str, float]  # seconds per stage of the job after the load and the text (``table_stages``)
    device_bytes: float  # peak device memory of the busiest process
    host_bytes: float  # peak host memory of the driver
    device_memory: float  # the device's memory (0: unknown)
    notes: list[str]  # assumptions worth reading

    @property
    def seconds(self) -> float:
        return float(sum(self.parts.values()))

    @property
    def fits(self) -> bool | None:
        return None if not self.device_memory else self.device_bytes <= self.device_memory


def estimate_build(shape: ModelShape, spec: TableSpec, profile: DeviceProfile, dtype_bytes: int, stream=False, workers=1) -> BuildEstimate:
    """Time and peak memory of building ``spec``'s table for ``shape``: ``dtype_bytes`` a value, ``workers`` Ray workers."""
    estimator, L, tokens = ESTIMATORS[spec.estimator], shape.layers, spec.windows.n_samples * spec.windows.seq_len
    block_t, head_t = shape.flops(spec.windows.seq_len) / profile.block_flops, 2.0 * shape.hidden * shape.vocab / profile.head_flops
    forward = tokens * (L * block_t + head_t)
    notes, per_layer = ["backward = 2 x forward FLOPs", "host transfers not counted"], 0
    main = stage.GRADIENT_PASS if estimator.reads_gradients else stage.CELLS  # the stage that measures the table
    parts = {stage.SCORE_UNITS: CRITERIA[spec.criterion].score_passes * forward}
    if estimator.reads_gradients:  # forward and backward(s); streamed, each block runs forward again before its backward
        parts[main] = (estimator.gradient_passes + stream) * forward
    if estimator.measures_cells:  # a dense pass, then the cells (exact: stages of their own; refine: inside its gradient pass's)
        parts[stage.DENSE_PASS if main == stage.CELLS else main] = parts.get(main, 0.0) + forward
        parts.setdefault(main, 0.0)
        per_layer = distinct_cuts_per_layer(shape, spec.rate_grid, spec.mode, spec.channel_multiple)
        if estimator.reads_gradients:  # refine measures the cells the plans use
            per_layer = min(per_layer, REFINE_CELLS * (2 if spec.mode == "split" else 1))
            notes.append(f"{spec.estimator} = a fisher pass + {REFINE_CELLS} measured cells per component")
    costs = {i: per_layer * tokens * ((L - i) * block_t + head_t) for i in range(L)} if per_layer else {}
    n_workers = min(workers, sum(1 for c in costs.values() if c)) if workers > 1 and costs else 1
    parts[main] += sum(costs.values()) / n_workers  # Ray workers share the cells evenly
    parts[main] += len(table_components(L, spec.mode)) * len(spec.rate_grid) * CELL_BOOKKEEPING_S  # every cell's units chosen
    state, in_flight = tokens * shape.hidden * dtype_bytes, 0.0  # one (N, T, d) hidden state
    if stream and per_layer:  # streamed cells go in groups whose states fill half the free device memory
        free = profile.memory - (shape.total_params - (L - 1) * shape.block_params) * dtype_bytes
        in_flight = min(per_layer * L * state, free / 2 if profile.memory else STREAM_GROUP_BYTES)
    device_bytes, host_bytes = _memory(shape, spec, dtype_bytes, stream, n_workers, in_flight, profile.kind)
    return BuildEstimate(shape.name, spec.estimator, profile.name, profile.basis, n_workers, stream, per_layer * L, parts,
                         device_bytes, host_bytes, profile.memory, notes)  # fmt: skip


def _memory(shape: ModelShape, spec: TableSpec, dtype_bytes: int, stream: bool, workers: int, in_flight: float, kind: str) -> tuple:
    """(peak device bytes of the busiest process, peak host bytes of the driver); ``in_flight``: the
    streamed cells' states held on the device."""
    n, t, b, L, estimator = spec.windows.n_samples, spec.windows.seq_len, spec.windows.batch_size, shape.layers, ESTIMATORS[spec.estimator]
    weights, block, state = shape.total_params * dtype_bytes, shape.block_params * dtype_bytes, n * t * shape.hidden * dtype_bytes
    resident = weights - (L - 1) * block if stream else weights  # streamed: one block on the device at a time
    # One batch: model-dtype logits with their float32 copy and log-probabilities, the widest activations (the
    # CPU's attention holds its T x T scores), every block's when a resident backward pass follows (twice streamed).
    activations = b * t * (2 * shape.intermediate + 4 * shape.hidden) * dtype_bytes
    activations += b * shape.heads * t * t * dtype_bytes if kind == "cpu" else 0
    working = b * t * shape.vocab * (dtype_bytes + 8) + activations
    gradient = resident + (2 * working + 2 * state if stream else working + (L - 1) * activations) if estimator.reads_gradients else 0.0
    host = weights + (L + 2) * state if stream and estimator.reads_gradients else 0.0  # a streamed gradient pass keeps each block's input
    if estimator.measures_cells:  # dense block inputs and final states, and the dense log-probabilities where they are kept
        logprobs = n * t * shape.vocab * 4
        stored = (L + 1) * state + (logprobs if spec.objective == "kl" and logprobs <= MAX_STORED_LOGPROB_BYTES else 0)
        gradient = max(gradient, resident + working + (in_flight + state if stream else stored / workers))  # Ray: each its layers' inputs
        host = max(host, weights + stored if stream else 0.0)
    return float(gradient), float(host)


def predict_build(
    model: str, spec: TableSpec, device: DeviceSpec | None, workers: int = 1, profile: str | None = None, measure=True, refresh=False
) -> BuildEstimate | None:
    """What `gap table --dry-run` prints and Setup's Estimate shows for ``model`` (a built-in or planning name, folder
    or hub id: its config is read), priced on a spec sheet (``profile``) or this machine's speed, measured when
    nothing is cached and ``measure`` (else None is returned), or again when ``refresh``."""
    placement, shape, w = resolve(device), model_shape(model), spec.windows
    if profile is not None:
        if profile not in SPEC_PROFILES:
            raise TableError(f"unknown --profile '{profile}'; choose one of {', '.join(SPEC_PROFILES)}")
        return estimate_build(shape, spec, SPEC_PROFILES[profile], 2, placement.stream, workers)
    prices = measured_profile(placement, shape, min(w.seq_len, 512), min(w.batch_size, 4), refresh, measure)
    return None if prices is None else estimate_build(shape, spec, prices, placement.dtype.itemsize, placement.stream, workers)


def table_prediction(model: str, spec: TableSpec, device: DeviceSpec | None = None, loaded=False, cached=False) -> Prediction | None:
    """The stages of a table job (``stages.table_stages``; None when nothing honest can be said); ``loaded``: the model
    is in memory; ``cached``: the cache holds the table (the job loads the model and reads the text, then the table)."""
    placement = resolve(device)
    if (priced := _prices(model, placement, spec.windows.seq_len, spec.windows.batch_size)) is None:
        return None
    shape, profile = priced
    first = {stage.LOAD_MODEL: 0.0 if loaded else load_seconds(model, shape.total_params), stage.READ_TEXT: READ_TEXT_S}
    if cached:  # the cache hit it is
        basis = f"cached here: Build reads it instead of building; {PREDICTED}: {profile.basis}"
        return with_learned_factor(Prediction(first, basis, kind="table read", prices=profile.basis))
    parts = estimate_build(shape, spec, profile, placement.dtype.itemsize, placement.stream).parts
    return with_learned_factor(Prediction(first | parts, f"{PREDICTED}: {profile.basis}", kind="table", prices=profile.basis))


def _obs_greedy_seconds(shape: ModelShape) -> float:  # half of every block's channels: an upper bound at usual budgets
    return shape.layers * channel_greedy_bytes(shape.intermediate, shape.hidden, shape.intermediate // 2) / NOMINAL_BANDWIDTH


def plan_seconds(allocator: str, calib: float, without_model: float) -> float:
    """One plan of ``allocator``: its entry's ``plan_passes`` of ``calib`` seconds each, or ``without_model`` if none."""
    passes = ALLOCATORS[allocator].plan_passes
    return passes * calib if passes else without_model


def run_prediction(
    model: str, calibration: WindowSpec, settings: EvalSettings, stages: tuple[str, ...], allocator: str = "dp",
    task_examples: int = 0, device: DeviceSpec | None = None, loaded: bool = False, sequential: bool = False,
    obs_samples: int | None = None, fit_samples: int | None = None,
) -> Prediction | None:  # fmt: skip
    """The stages of a prune-and-evaluate run (``runs.prune_eval_stages``) in forward passes of the dense model (the pruned
    copy priced as dense: an upper bound): planning (the calibration passes its allocator's entry prices it at), scores
    (``sequential``: OBS's 3 block passes over its ``obs_samples`` windows, ``config.obs_window_count``, and its channel
    greedy), compensation (2.5 passes over its ``fit_samples`` windows, None: the calibration's), the measured
    increase, held-out text, throughput, generations and lm-eval tasks of both models, the checkpoint write."""
    if (priced := _prices(model, resolve(device), settings.windows.seq_len, settings.windows.batch_size)) is None:
        return None
    shape, profile = priced

    def forward(tokens: float, seq_len: int, calls: float = 1.0) -> float:
        return forward_seconds(shape, profile, tokens, seq_len, calls)

    c, w, params = calibration, settings.windows, shape.total_params
    calib = forward(c.n_samples * c.seq_len, c.seq_len, c.n_samples / c.batch_size)
    obs = obs_window_count(c.n_samples, obs_samples)
    obs_pass = forward(obs * c.seq_len, c.seq_len, obs / c.batch_size)
    fit = c.n_samples if fit_samples is None else fit_samples
    fit_pass = forward(fit * c.seq_len, c.seq_len, fit / c.batch_size)
    by_stage = {
        stage.LOAD_MODEL: 0.0 if loaded else load_seconds(model, params),
        stage.PLAN: plan_seconds(allocator, calib, 0.5),
        stage.PRUNE: (3 * obs_pass + _obs_greedy_seconds(shape) if sequential else calib) + 4 * params / NOMINAL_BANDWIDTH,
        stage.COMPENSATE: 2.5 * fit_pass,  # per block: to o_proj's input, to down_proj's input, the whole block
        stage.MEASURE: 2 * calib,
        stage.HELD_OUT: 2 * max(len(w.sources()), 1) * forward(w.n_samples * w.seq_len, w.seq_len, w.n_samples / w.batch_size),
        stage.THROUGHPUT: THROUGHPUT_REPEATS * 2 * (forward(4 * 128, 128) + 16 * forward(4, 1)),
        stage.GENERATE: 2 * settings.generations * settings.max_new_tokens * forward(1, 1),
        stage.TASKS: (0.0 if "lm_eval" in sys.modules else TASK_IMPORT_S) + 2 * scoring_seconds(task_examples, forward),
        stage.SAVE: LOAD_FIXED_S + 4 * params / SAVE_BYTES_PER_S,
    }
    seconds = {name: by_stage[name] for name in stages if name in by_stage}
    basis, tasks_s = f"{PREDICTED}: {profile.basis}", seconds.get(stage.TASKS, 0.0)
    return with_learned_factor(Prediction(seconds, basis, tasks_s=tasks_s, kind="prune_eval", prices=profile.basis))


def recovery_prediction(
    folder: str | Path, settings: RecoverySettings, placement: Placement | None = None, task_examples: int = 0
) -> Prediction | None:
    """The stages of recovering the checkpoint in ``folder`` (``core.progress.RECOVERY_STAGES``; None without a config.json): a
    LoRA step 3 student forwards, a ZO step 2 and ``z`` drawn thrice a weight, kd a teacher pass more; loads, evaluations, MaZO's
    importance, the rate probe; teacher text not cached (``teacher_text_seconds``); each judgement's slice or KL."""
    s, shapes = settings.validate(), checkpoint_shapes(folder)
    priced = None if shapes is None else _prices(shapes[0], placement or resolve(None), s.seq_len, s.batch_size)
    if shapes is None or priced is None:
        return None
    (dense, blocks), profile, tasks = shapes, priced[1], len(s.tasks)

    def student(tokens: float, seq_len: int, calls: float = 1.0) -> float:
        return forward_seconds(dense, profile, tokens, seq_len, calls, blocks)

    def teacher(tokens: float, seq_len: int, calls: float = 1.0) -> float:
        return forward_seconds(dense, profile, tokens, seq_len, calls) if s.compare_dense else 0.0

    batch = (tasks * s.batch_size * s.seq_len, s.seq_len, tasks)
    rows = {"q": "heads", "o": "heads", "k": "kv_heads", "v": "kv_heads"}  # a ZO step perturbs the targets (MaZO: a fraction)
    perturbed = sum(b.hidden * (getattr(b, rows[t]) * b.head_dim if t in rows else b.intermediate) for b in blocks for t in s.targets)
    method = RECOVERY_METHODS[s.method]
    drawn = perturbed * (s.mask_fraction if method.masked else 1.0) if method.draws_noise else 0.0
    z_draw = Z_DRAW_S_PER_VALUE * NOMINAL_FLOPS_PER_THREAD / profile.block_flops if profile.kind == "cpu" else 0.0  # GPUs: memory speed
    step = method.step_passes * student(*batch) + 3 * drawn * z_draw
    step += forward_seconds(dense, profile, *batch) if s.objective != "lm" else 0.0
    texts = len(s.heldout_texts)
    held_out = (texts * s.eval_samples * s.eval_seq_len, s.eval_seq_len, texts * s.eval_samples / 4)
    generated = s.eval_generations * EvalSettings().max_new_tokens
    evaluation = student(*held_out) + teacher(*held_out) + generated * (student(1, 1) + teacher(1, 1))
    calib = student(tasks * s.calib_eval_windows * s.seq_len, s.seq_len, tasks)
    prepare = calib + (evaluation if s.evaluate_before else 0.0)
    prepare += student(tasks * s.importance_windows * s.seq_len, s.seq_len, tasks) if method.masked else 0.0
    prepare += len(PROBE_FACTORS) * (PROBE_STEPS * step + calib) if s.probes_lr else 0.0
    prepare += load_seconds(str(folder), dense.total_params) * (2 if s.objective != "lm" or s.compare_dense or s.teacher_source else 1)
    dtype = str((placement or resolve(None)).dtype).removeprefix("torch.")  # the teacher text's cache key has it
    text_tokens = uncached_tokens(Path(folder).expanduser(), s.teacher_source, s.seq_len, s.seed, s.teacher, dtype)
    text = teacher_text_seconds(dense, profile, text_tokens, s.seq_len) if text_tokens else 0.0
    first = after = 0.0
    if task_examples > 0:
        after = scoring_seconds(task_examples, student)
        first = (0.0 if "lm_eval" in sys.modules else TASK_IMPORT_S) + after + scoring_seconds(task_examples, teacher)
        first, after = (first, after) if s.evaluate_before else (0.0, first)
    budget = min((b for b in (s.time_budget_s, s.cpu_budget_s) if b), default=None)
    steps = s.steps if budget is None or not step else min(s.steps, int(budget / step))
    judged = len(s.eval_tasks) * s.eval_task_examples  # a judgement: a task slice, else the KL windows through both models
    judge = scoring_seconds(judged, student) if judged else student(*held_out) + forward_seconds(dense, profile, *held_out)
    judgements = 1 + steps // s.eval_every + bool(steps % s.eval_every) if s.eval_every else 0
    training = (step * steps if budget is None else min(step * s.steps, budget)) + judgements * judge
    seconds = {stage.PREPARING: prepare + first + text, stage.TRAINING: training, stage.EVALUATING_AFTER: calib + evaluation + after}
    basis = f"{PREDICTED}: {profile.basis}"
    return with_learned_factor(
        Prediction(seconds, basis, step, first + after, text, judgements * judge, judgements, "recover", profile.basis)
    )


def teacher_text_seconds(shape: ModelShape, profile: DeviceProfile, tokens: int, seq_len: int) -> float:
    """Writing ``tokens`` of teacher text with a model of ``shape`` (``recover.teacher_text``): sequences of ``seq_len``
    decoded in batches of ``BATCH``, a token at a time (GENERATION_FACTOR dense forwards a token, one call per block
    a step), each token drawn from the nucleus of its row, priced as a whole sort (on the CPU; an accelerator's is
    negligible next to its forward)."""
    spec = TeacherTextSpec(tokens=max(int(tokens), 1), seq_len=seq_len, seed=0)
    written, steps = spec.sequences * seq_len, spec.batches * seq_len
    decode = GENERATION_FACTOR * forward_seconds(shape, profile, written, seq_len) + steps * shape.layers * CALL_SECONDS_PER_BLOCK
    per_value = NOMINAL_FLOPS_PER_THREAD / profile.block_flops * (NUCLEUS_TOP_S_PER_VALUE + NUCLEUS_SORT_S_PER_VALUE)
    return decode + (written * shape.vocab * per_value if profile.kind == "cpu" else 0.0)


def teacher_text_prediction(teacher: LoadedModel, tokens: int, seq_len: int) -> tuple[float, str] | None:
    """(seconds, where the prices come from) of ``teacher`` writing ``tokens`` of teacher text on the device it is
    placed on (``teacher_text_seconds``); None on an accelerator nobody measured."""
    shape = ModelShape.from_config(teacher.model.config, teacher.name)
    priced = _prices(shape, placement_of(teacher), seq_len, BATCH)
    if priced is None:
        return None
    return teacher_text_seconds(shape, priced[1], tokens, seq_len), f"{PREDICTED}: {priced[1].basis}"


def baselines_prediction(
    model: str, windows: WindowSpec, criterion: str, allocators: list[str], budgets: int, loaded: bool = False
) -> Prediction | None:
    """The stages of baseline plans (``runs.baseline_stages``): the load, the unit scores an allocator asks for first (FLAP; priced as its criterion's), and
    per plan the calibration passes its allocator's entry prices it at (a moment for none)."""
    if (priced := _prices(model, resolve(None), windows.seq_len, windows.batch_size)) is None:
        return None
    shape, profile = priced
    calib = forward_seconds(shape, profile, windows.n_samples * windows.seq_len, windows.seq_len, windows.n_samples / windows.batch_size)
    seconds = {stage.LOAD_MODEL: 0.0 if loaded else load_seconds(model, shape.total_params)}
    if any(ALLOCATORS[a].scores_first for a in allocators):
        seconds[stage.SCORE_UNITS] = CRITERIA[criterion].score_passes * calib
    seconds[stage.PLAN] = budgets * sum(plan_seconds(a, calib, 0.05) for a in allocators)
    return with_learned_factor(Prediction(seconds, f"{PREDICTED}: {profile.basis}", kind="baselines", prices=profile.basis))
