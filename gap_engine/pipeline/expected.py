"""What a job will take before any job like it ran on this machine: the cost model's prediction.

``core.buildtime`` expects a stage to take what the same stage of earlier jobs took here. On
a fresh machine, for a new model or a first run there is no such job, and a time-left that
appears only once the job has measured itself comes too late to be of use (issue 22: a first
default build showed none for 73% of its run). This module fills those stages from the cost
model (``tables.costmodel``): the work of each stage counted in forward passes and priced with
this machine's measured profile when one is cached (the Setup page's "Estimate" or a recovery
measures it), else with a nominal CPU profile scaled by torch's thread count. The basis says
which, and the pages label the result a prediction; the running job's own rates replace it.

Constants marked "nominal" are priors, not measurements of any machine; the test
``bench/bench_expected.py`` measures the predictions against real table builds, task scoring and
GGUF builds of the built-in model (within 2x, as issue 22 asks; a benchmark, since a clock in a
test fails on a busy machine).
"""

from __future__ import annotations

from pathlib import Path

from gap_engine.core.config import WindowSpec
from gap_engine.core.device import DeviceSpec, resolve
from gap_engine.core.fsutil import cache_root
from gap_engine.core.progress import (
    COMPENSATE,
    GENERATE,
    HELD_OUT,
    LOAD_MODEL,
    MEASURE,
    PLAN,
    PRUNE,
    READ_TEXT,
    SAVE,
    TASKS,
    THROUGHPUT,
)
from gap_engine.evaluate.metrics import THROUGHPUT_REPEATS, EvalSettings
from gap_engine.evaluate.tasks import TASK_IMPORT_S, scoring_seconds
from gap_engine.model.loading import BUILTIN_MODELS, CONVERTED_MARKER
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.costmodel import (  # the nominal prices live with the profiles; re-exported for the pages' estimates
    LOAD_BYTES_PER_S,
    LOAD_FIXED_S,
    NOMINAL_BANDWIDTH,
    NOMINAL_BASIS,
    DeviceProfile,
    ModelShape,
    estimate_build,
    folder_load_seconds,
    measured_profile,
    model_shape,
    nominal_for,
    nominal_profile,  # noqa: F401 - re-exported: the tests price with it as the pages do
    scoring_profile,
    stage_seconds,
)

CALL_SECONDS_PER_BLOCK = 4e-4  # nominal: Python and kernel-launch cost of one block call (decode steps are made of them)
DEQUANT_S_PER_PARAM = 2.5e-7  # nominal: a built-in's first use de-quantizes its GGUF (README: 20-60 s)
READ_TEXT_S = 3.0  # nominal: the first read of a built-in text (parsing, tokenizing) takes seconds
SAVE_BYTES_PER_S = 100e6  # nominal: writing a checkpoint (safetensors, model card, remote code)


def profile_for(device: DeviceSpec, shape: ModelShape, windows: WindowSpec) -> DeviceProfile | None:
    """This machine's measured profile when cached (never measured here: that takes seconds),
    else the nominal CPU profile; None on an accelerator never measured (no honest prior)."""
    placement = resolve(device)
    measured = measured_profile(placement, shape, seq_len=min(windows.seq_len, 512), batch=min(windows.batch_size, 4), measure=False)
    return measured if measured is not None else nominal_for(placement)


def load_seconds(model: str, shape: ModelShape) -> float:
    """Predicted seconds to load ``model`` (built-ins: de-quantizing the GGUF on first use)."""
    folder = cache_root() / "models" / model if model in BUILTIN_MODELS else Path(model).expanduser()
    if model in BUILTIN_MODELS and not (folder / CONVERTED_MARKER).is_file():
        return folder_load_seconds(None, shape.total_params) + shape.total_params * DEQUANT_S_PER_PARAM
    return folder_load_seconds(folder, shape.total_params)


def forward_seconds(shape: ModelShape, profile: DeviceProfile, tokens: float, seq_len: int, calls: float = 0.0) -> float:
    """One forward pass of the whole model over ``tokens`` in windows of ``seq_len``, plus the
    fixed cost of ``calls`` model calls (one call runs every block once)."""
    from gap_engine.tables.costmodel import block_flops_per_token, head_flops_per_token

    per_token = (
        shape.layers * block_flops_per_token(shape, seq_len) / profile.block_flops + head_flops_per_token(shape) / profile.head_flops
    )
    return tokens * per_token + calls * shape.layers * CALL_SECONDS_PER_BLOCK


def cheap_shape(model: str) -> ModelShape | None:
    """The model's shape when it can be read without loading weights (a built-in, a folder with
    its config.json); None otherwise: a prediction must never load a model."""
    folder = Path(model).expanduser()
    if model in BUILTIN_MODELS or (folder / "config.json").is_file():
        return model_shape(model)
    return None


def table_prediction(model: str, spec: TableSpec, device: DeviceSpec = DeviceSpec()) -> tuple[dict[str, float], str] | None:
    """(stage -> predicted seconds, basis) of building ``spec``'s table of ``model``; None when
    nothing honest can be said (an accelerator never measured, a model whose shape is unknown)."""
    shape = cheap_shape(model)
    profile = None if shape is None else profile_for(device, shape, spec.windows)
    if shape is None or profile is None:
        return None
    placement = resolve(device)
    estimate = estimate_build(shape, spec, profile, placement.dtype.itemsize, stream=placement.stream)
    stages = {LOAD_MODEL: load_seconds(model, shape), READ_TEXT: READ_TEXT_S} | stage_seconds(estimate)
    return stages, _basis(profile)


def run_prediction(
    model: str,
    calibration: WindowSpec,
    settings: EvalSettings,
    stages: tuple[str, ...],
    allocator: str = "dp",
    task_examples: int = 0,
    device: DeviceSpec = DeviceSpec(),
) -> tuple[dict[str, float], str] | None:
    """(stage -> predicted seconds, basis) of a prune-and-evaluate run (``runs.prune_eval_stages``).

    Work per stage, in forward passes of the dense model (the pruned copy is priced as dense:
    an upper bound): planning (one calibration pass for allocators that read windows), the
    importance scores (one calibration pass), the compensation (about two and a half calibration
    passes), the measured increase (dense and pruned over the
    calibration windows), the held-out evaluation (both models over every source's windows),
    throughput (``THROUGHPUT_REPEATS`` x both models: a 4 x 128 prefill and 16 decode steps),
    greedy generations (both models, one call per new token), lm-eval tasks (both models, four
    continuations per example, plus lm-eval's import) and the checkpoint write.
    """
    shape = cheap_shape(model)
    profile = None if shape is None else profile_for(device, shape, settings.windows)
    if shape is None or profile is None:
        return None
    calib_tokens = calibration.n_samples * calibration.seq_len
    calib = forward_seconds(shape, profile, calib_tokens, calibration.seq_len, calibration.n_samples / calibration.batch_size)
    windows = settings.windows
    sources = max(len(windows.sources()), 1)
    held_out = forward_seconds(shape, profile, windows.n_samples * windows.seq_len, windows.seq_len, windows.n_samples / windows.batch_size)
    decode_step = forward_seconds(shape, profile, 1, 1, 1)
    scoring = (scoring_profile(resolve(device), shape, measure=False) or profile) if task_examples else profile  # lm-eval's own batches
    throughput = THROUGHPUT_REPEATS * 2 * (forward_seconds(shape, profile, 4 * 128, 128, 1) + 16 * forward_seconds(shape, profile, 4, 1, 1))
    by_stage = {
        LOAD_MODEL: load_seconds(model, shape),
        PLAN: calib if allocator in ("flap", "owl") else (20 * calib if allocator == "evo" else 0.5),
        PRUNE: calib + 4 * shape.total_params / NOMINAL_BANDWIDTH,  # scores, then a copy of the weights
        COMPENSATE: 2.5 * calib,  # per block: to o_proj's input, to down_proj's input, the whole block (compensation_pass)
        MEASURE: 2 * calib,
        HELD_OUT: 2 * sources * held_out,
        THROUGHPUT: throughput,
        GENERATE: 2 * settings.generations * settings.max_new_tokens * decode_step,
        TASKS: TASK_IMPORT_S
        + 2 * scoring_seconds(task_examples, lambda tokens, seq_len: forward_seconds(shape, scoring, tokens, seq_len, 1)),
        SAVE: LOAD_FIXED_S + 4 * shape.total_params / SAVE_BYTES_PER_S,
    }
    return {stage: by_stage[stage] for stage in stages if stage in by_stage}, _basis(profile)


def _basis(profile: DeviceProfile) -> str:
    return f"the cost model on {profile.basis}" if profile.basis == NOMINAL_BASIS else f"the cost model ({profile.basis})"


GGUF_SECONDS_PER_PARAM = {"q8_0": 1.5e-8, "f16": 5e-9}  # nominal: quantizing to q8_0 (numpy, one thread) vs casting to float16
GGUF_FIXED_S = 1.5  # nominal: reading the tokenizer, writing the metadata
# nominal: importing transformers' model code, which the first build in a process pays: it was
# 4-6 s of a cold 9 s q8_0 build of a 113M-parameter checkpoint, whose warm builds took 3-4 s
GGUF_IMPORT_S = 4.0


def gguf_seconds(checkpoint: str | Path, outtype: str) -> float | None:
    """Predicted seconds to build the GGUF file of ``checkpoint`` (``deploy.gguf.gguf_bytes``):
    loading it, converting every matrix, writing the file, and importing transformers' model code
    where this process has not yet; None without a readable config.json."""
    import json
    import sys

    from gap_engine.recover.cost import layer_shapes

    folder = Path(checkpoint).expanduser()
    try:
        dense, blocks = layer_shapes(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    params = dense.total_params - dense.layers * dense.block_params + sum(block.block_params for block in blocks)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) or 4 * params
    imports = 0.0 if "transformers.modeling_utils" in sys.modules else GGUF_IMPORT_S
    return (
        GGUF_FIXED_S
        + imports
        + size / (2 * LOAD_BYTES_PER_S)
        + params * GGUF_SECONDS_PER_PARAM.get(outtype, GGUF_SECONDS_PER_PARAM["q8_0"])
    )
