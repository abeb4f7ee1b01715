"""Evaluate a model spread over several devices with accelerate's ``device_map``.

Layer streaming (``--stream``) moves one block at a time through one accelerator: the right
tool for table builds, whose passes go block-major over many windows. Evaluation runs
window after window through the whole model and generates token by token, where streaming
would move every block per token. A model larger than one GPU is instead split across the
GPUs of one machine, as ``from_pretrained(device_map="auto")`` does: accelerate places
whole blocks on each device (a decoder block is never split) and hooks move the hidden
states from one device to the next. What does not fit any accelerator stays on the host,
and what does not fit the host goes to an offload folder on disk.

The model is loaded on the host in the asked dtype first (a gap checkpoint's per-layer
shapes need our own loader), then dispatched. Numbers are those of the same model on one
device: the same arithmetic, only on other devices (``tests/model/test_dispatch.py`` checks it on
the CPU, with blocks offloaded to disk).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from gap_engine.core import memory
from gap_engine.core.config import DEVICE_MAPS
from gap_engine.core.device import DeviceError, DeviceSpec, Placement, dtype_name, resolve
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.loading import load_model

log = logging.getLogger(__name__)

MaxMemory = dict[int | str, str]  # accelerate's max_memory: GPU index or "cpu"/"mps"/"disk" -> size


def parse_max_memory(text: str | None) -> MaxMemory | None:
    """``cuda:0=70GiB,cpu=200GiB`` -> {0: '70GiB', 'cpu': '200GiB'} (``memory.parse_max_memory``).

    Raises:
        DeviceError: an entry that is not DEVICE=SIZE.
    """
    return memory.parse_max_memory(text, DeviceError)


def plan_device_map(lm: LoadedModel, strategy: str = "auto", max_memory: MaxMemory | None = None) -> dict[str, str | int]:
    """Module name -> device (GPU index, 'cpu' or 'disk') for ``lm``, whole blocks per device.

    Raises:
        DeviceError: an unknown strategy.
    """
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if strategy not in DEVICE_MAPS:
        raise DeviceError(f"unknown device map '{strategy}'; choose one of {', '.join(DEVICE_MAPS)}")
    model = lm.model
    no_split = sorted({type(layer).__name__ for layer in lm.adapter.layers(model)})
    dtype = next(model.parameters()).dtype
    if strategy != "sequential":
        max_memory = get_balanced_memory(
            model, max_memory, no_split_module_classes=no_split, dtype=dtype, low_zero=strategy == "balanced_low_0"
        )
    return dict(infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype))


def dispatch_lm(lm: LoadedModel, device_map: dict[str, str | int], offload_dir: str | Path | None = None) -> LoadedModel:
    """Place ``lm`` (on the host) as ``device_map`` says; returns ``lm``.

    Args:
        lm: a LoadedModel whose weights are on the host, in the dtype it will run in.
        device_map: module name -> device, as ``plan_device_map`` gives it (or written by hand).
        offload_dir: where modules mapped to 'disk' keep their weights.
    Raises:
        DeviceError: modules mapped to 'disk' without an offload folder.
    """
    from accelerate import dispatch_model

    disk = sorted(name or "(the whole model)" for name, device in device_map.items() if device == "disk")
    if disk and offload_dir is None:
        raise DeviceError(
            f"the model does not fit the devices' memory ({', '.join(disk[:3])} would go to disk): give --offload-dir, or more --max-memory"
        )
    accelerators = sorted({device for device in device_map.values() if device not in ("cpu", "disk")}, key=str)
    main = accelerators[0] if accelerators else "cpu"
    if offload_dir is not None:
        Path(offload_dir).mkdir(parents=True, exist_ok=True)
    dispatch_model(lm.model, device_map=device_map, main_device=main, offload_dir=str(offload_dir) if offload_dir else None)
    dtype = next(lm.model.parameters()).dtype
    lm.placement = Placement(device=torch.device(f"cuda:{main}" if isinstance(main, int) else main), dtype=dtype, stream=False)
    lm.device_map = dict(device_map)
    log.info("%s dispatched over %s", lm.name, describe_device_map(device_map))
    return lm


def describe_device_map(device_map: dict[str, str | int]) -> str:
    """'cuda:0: 14 modules, cuda:1: 16 modules, disk: 2 modules' (for logs and reports)."""
    counts: dict[str, int] = {}
    for device in device_map.values():
        name = f"cuda:{device}" if isinstance(device, int) else str(device)
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name}: {n} module{'s' if n != 1 else ''}" for name, n in counts.items())


def load_dispatched(
    name_or_path: str,
    dtype: str = "auto",
    strategy: str = "auto",
    max_memory: MaxMemory | None = None,
    offload_dir: str | Path | None = None,
    hub: bool = True,
) -> LoadedModel:
    """``loading.load_model`` on the host in ``dtype`` (resolved as ``--device auto`` resolves it:
    what the accelerator runs, float32 without one), then spread over the devices
    (``plan_device_map``, ``dispatch_lm``). ``hub`` as in ``load_model``."""
    dtype = dtype_name(resolve(DeviceSpec("auto", dtype)).dtype)
    lm = load_model(name_or_path, DeviceSpec("cpu", dtype), hub=hub)
    return dispatch_lm(lm, plan_device_map(lm, strategy, max_memory), offload_dir)
