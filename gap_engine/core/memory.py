"""Peak resident memory of this process, measured rather than estimated.

Recovery reports how much memory a fine-tuning method needs against plain inference of the
same model. Both are read the same way: the kernel's high-water mark of resident memory
(``VmHWM`` in ``/proc/self/status``), reset just before the phase with
``/proc/self/clear_refs`` (value 5, Linux 4.0+), so one process can measure several phases
one after another. Where that interface is missing (macOS, Windows, a locked-down /proc),
a background thread samples the resident size with psutil every few milliseconds instead;
it can miss a spike shorter than its period, which the report states.

The high-water mark belongs to the whole process: work running in other threads at the same
time (another job in the app) counts too.

Also here, as the one torch-free home for memory sizes: ``parse_max_memory``, the
per-device limits of ``gap eval --device-map`` (checked before anything loads).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import re
import threading
from pathlib import Path

import psutil

# accelerate's size strings: a whole number of bytes, or a number with a decimal or binary unit.
_SIZE = re.compile(r"^\d{1,15}(\.\d{1,6})?\s*([KMGT]i?B)?$", re.IGNORECASE)


def parse_max_memory(text: str | None, error: type[Exception]) -> dict[int | str, str] | None:
    """``cuda:0=70GiB,cpu=200GiB`` -> {0: '70GiB', 'cpu': '200GiB'} (accelerate's keys); None stays None.

    Args:
        text: the --max-memory value.
        error: the GapError subclass to raise (one line).
    """
    if not text:
        return None
    out: dict[int | str, str] = {}
    for part in str(text).split(","):
        name, sep, size = part.strip().partition("=")
        name, size = name.strip().lower(), size.strip()
        if not sep or not name or not size:
            raise error(f"--max-memory entry '{part.strip()[:80]}' is not DEVICE=SIZE (e.g. cuda:0=70GiB,cpu=200GiB)")
        if not _SIZE.match(size):
            raise error(f"--max-memory: '{size[:40]}' is not a size (bytes, or a number with KB/MB/GB/TB or KiB/MiB/GiB/TiB)")
        key: int | str
        if name.startswith("cuda"):
            index = name.partition(":")[2] or "0"
            if not (index.isascii() and index.isdigit()) or len(index) > 4:  # "²".isdigit() is True, int("²") fails
                raise error(f"--max-memory: '{name[:40]}' is not cuda or cuda:N")
            key = int(index)
        elif name in ("cpu", "mps", "disk"):
            key = name
        else:
            raise error(f"--max-memory: unknown device '{name[:40]}' (cuda:N, cpu or mps)")
        if key in out:  # "cpu=1GB,cpu=2GB" would keep the last one silently
            raise error(f"--max-memory names {'cuda:' + str(key) if isinstance(key, int) else key} twice; give each device one size")
        out[key] = size
    return out


log = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)
_SAMPLE_PERIOD_S = 0.005


def current_rss() -> int:
    """Resident memory of this process now, in bytes."""
    return int(psutil.Process().memory_info().rss)


def release_free_memory(collect_garbage: bool = True) -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so a phase measured next
    does not inherit the resident leftovers of the one before.

    Args:
        collect_garbage: run ``gc.collect()`` first (seconds in a process holding a large
            Python heap; needed only when something with reference cycles was just dropped).
    """
    if collect_garbage:
        gc.collect()
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return
    try:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


def _read_hwm() -> int | None:
    try:
        match = _HWM.search(_STATUS.read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


class PeakRSS:
    """The peak resident memory of this process from :meth:`reset` to :meth:`peak`.

    Use ``with PeakRSS() as meter: ...; meter.peak()`` or call ``reset``/``peak``/``stop``.
    """

    def __init__(self) -> None:
        self.method = ""  # "VmHWM" (kernel high-water mark) or "psutil sampling"
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled = 0

    def reset(self) -> PeakRSS:
        """Start measuring from the current resident size."""
        self.stop()
        try:
            _CLEAR_REFS.write_text("5")
            if _read_hwm() is not None:
                self.method = "VmHWM"
                return self
        except OSError:
            pass
        self.method = "psutil sampling"
        self._sampled = current_rss()
        self._stop.clear()
        self._sampler = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(_SAMPLE_PERIOD_S):
            self._sampled = max(self._sampled, int(process.memory_info().rss))

    def peak(self) -> int:
        """Bytes: the highest resident size since :meth:`reset` (at least the current one)."""
        if self.method == "VmHWM":
            value = _read_hwm()
            if value is not None:
                return value
        self._sampled = max(self._sampled, current_rss())
        return self._sampled

    def stop(self) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None

    def __enter__(self) -> PeakRSS:
        return self.reset()

    def __exit__(self, *exc: object) -> None:
        self.stop()
