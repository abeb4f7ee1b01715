"""Where the model runs and in which precision: ``--device`` and ``--dtype`` for every stage.

A ``DeviceSpec`` is what a user asks for (strings, checked without torch so the CLI parser
can validate them at once); ``resolve`` turns it into a ``Placement`` on this machine or
raises a one-line ``DeviceError`` naming what is missing. ``auto`` means the accelerator in
bfloat16 where one is present (CUDA, else Apple's MPS), otherwise the CPU in float32, which
is what every stage did before devices existed.

Two numerical rules hold whatever the model's dtype, so a bf16 table is a noisier version of
the fp32 one and not a differently defined one:

- objectives are computed from float32 logits and summed in float64 (``wide``);
- importance statistics (activation sums, squared sums, weight norms) accumulate in float64
  on the host.

MPS has no float64; there ``wide`` gives float32 (said in the docs, not hidden).

A placement may also *stream*: the blocks stay on the host and visit the device one at a
time (``layerwise``), as SparseGPT and Wanda do for models larger than the accelerator.
torch is imported only when a spec is resolved, so importing this module is cheap.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gap_engine.core.errors import GapError

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N", "mps")  # what --device accepts (N: a GPU index)
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # what --dtype accepts
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
SHORT_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d{1,3})?)$")


class DeviceError(GapError):
    """A device or dtype that this machine or this torch build cannot provide."""


@dataclass(frozen=True)
class DeviceSpec:
    """What the user asked for: a device, a dtype, and whether blocks stream from the host."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (fp32/bf16/fp16 accepted)
    stream: bool = False  # keep the model on the host and move one block at a time to the device

    def validate(self) -> DeviceSpec:
        """DeviceError (one line) for a device or dtype name no machine has; no torch needed."""
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.match(self.device.strip().lower()):
            raise DeviceError(f"unknown device '{self.device}'; choose one of {', '.join(DEVICE_CHOICES)}")
        if canonical_dtype(self.dtype) not in DTYPE_CHOICES:
            raise DeviceError(f"unknown dtype '{self.dtype}'; choose one of {', '.join(DTYPE_CHOICES)}")
        return self


CPU_FP32 = DeviceSpec("cpu", "float32")  # what every stage did before devices existed


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; other names unchanged (lower-cased)."""
    text = str(name).strip().lower()
    return DTYPE_ALIASES.get(text, text)


@dataclass(frozen=True)
class Placement:
    """A resolved DeviceSpec: where blocks compute, their dtype, and whether they stream."""

    device: torch.device  # where blocks compute
    dtype: torch.dtype  # weights and activations
    stream: bool = False  # blocks live on the host and visit ``device`` one at a time

    @property
    def host(self) -> bool:
        """True when the compute device is the CPU itself (nothing is ever moved)."""
        return self.device.type == "cpu"

    def describe(self) -> str:
        """'cuda:0 bf16 (streamed)' and the like, for logs, tables and the app."""
        name = str(self.dtype).removeprefix("torch.")
        return f"{self.device} {SHORT_DTYPE_NAMES.get(name, name)}" + (" (streamed)" if self.stream else "")


def cuda_ok() -> bool:
    import torch

    return torch.cuda.is_available()


def mps_ok() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _resolve_device(text: str) -> torch.device:
    import torch

    if text == "auto":
        return torch.device("cuda:0" if cuda_ok() else "mps" if mps_ok() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "mps":
        if not mps_ok():
            raise DeviceError("--device mps: the MPS backend is not available on this machine; use --device cpu")
        return torch.device("mps")
    if torch.version.cuda is None:
        raise DeviceError(
            f"--device {text}: this torch build ({torch.__version__}) has no CUDA support; use --device cpu or a CUDA build of torch"
        )
    count = torch.cuda.device_count() if cuda_ok() else 0
    if count == 0:
        raise DeviceError(f"--device {text}: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)")
    index = int(text.partition(":")[2] or 0)
    if index >= count:
        raise DeviceError(f"--device {text}: only {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})")
    return torch.device("cuda", index)


def _resolve_dtype(text: str, device: torch.device) -> torch.dtype:
    import torch

    if text == "auto":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16  # pre-Ampere GPUs have no bf16 units
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[text]


def resolve(spec: DeviceSpec | None) -> Placement:
    """The Placement for ``spec`` on this machine (None: CPU float32, resident).

    Raises:
        DeviceError: an unknown name, or a device this machine or torch build lacks.
    """
    import torch

    spec = (spec or CPU_FP32).validate()
    device = _resolve_device(spec.device.strip().lower())
    dtype = _resolve_dtype(canonical_dtype(spec.dtype), device)
    if device.type == "cpu" and dtype == torch.float16:
        log.warning("float16 on the CPU is slow and gains nothing over bfloat16; consider --dtype bfloat16")
    return Placement(device=device, dtype=dtype, stream=bool(spec.stream))


def dtype_without_torch(spec: DeviceSpec | None) -> str | None:
    """The dtype name `resolve` gives ``spec``, when it can be told without importing torch.

    That is on the CPU, and for ``auto`` where this torch build cannot reach an accelerator
    (its version file names no CUDA and no ROCm, and this is not macOS, where MPS may be);
    None otherwise, and then `resolve` must answer (it imports torch, about two seconds).
    The cache's no-load lookup uses it: a float32 CPU table is found without torch.
    """
    spec = (spec or CPU_FP32).validate()
    device, dtype = spec.device.strip().lower(), canonical_dtype(spec.dtype)
    if device == "cpu" or (device == "auto" and not _torch_may_reach_an_accelerator()):
        return "float32" if dtype == "auto" else dtype
    return None


def _torch_may_reach_an_accelerator() -> bool:
    """False only when torch's own version file says it was built for the CPU alone."""
    if sys.platform == "darwin":
        return True
    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return True
    try:
        text = (Path(found.submodule_search_locations[0]) / "version.py").read_text()
    except OSError:
        return True
    builds = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.+?)\s*$", text, re.MULTILINE))
    return not (builds.get("cuda") == "None" and builds.get("hip") == "None")


# ---- helpers the stages share ----------------------------------------------------------------
def placement_of(lm: Any) -> Placement:  # a model.loaded.LoadedModel (a layer above core)
    """The placement a LoadedModel runs with (as recorded, else read off its weights)."""
    recorded: Placement | None = getattr(lm, "placement", None)
    if recorded is not None:
        return recorded
    weight: torch.Tensor = lm.model.get_input_embeddings().weight
    return Placement(device=weight.device, dtype=weight.dtype, stream=False)


def input_device(model: Any) -> torch.device:  # a transformers model
    """Where token ids must be for ``model``: its embeddings' device (also when blocks stream);
    for embeddings accelerate offloaded (``dispatch``), the device its hook runs them on."""
    embeddings = model.get_input_embeddings()
    device: torch.device = embeddings.weight.device
    execution = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
    if device.type == "meta" and execution is not None:
        import torch

        return torch.device(f"cuda:{execution}" if isinstance(execution, int) else execution)
    return device


def is_streamed(lm: Any) -> bool:  # a LoadedModel, or anything else (not streamed)
    return bool(getattr(getattr(lm, "placement", None), "stream", False))


def wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in the widest float its device computes in: float64 (float32 on MPS)."""
    return tensor.float() if tensor.device.type == "mps" else tensor.double()


def cpu_float64(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float64 on the host (widened on its own device first, where that is possible)."""
    return wide(tensor).cpu().double()


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (timing on an accelerator measures nothing otherwise)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def available_devices() -> list[str]:
    """The device names this machine can resolve: auto, cpu, every visible cuda:N, mps."""
    import torch

    names = ["auto", "cpu"]
    if cuda_ok():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if mps_ok():
        names.append("mps")
    return names
