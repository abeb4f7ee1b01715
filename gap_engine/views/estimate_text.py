"""A table build's prediction as a person reads it: what `gap table --dry-run` prints and Setup shows."""

from __future__ import annotations

from gap_engine.pipeline.cost_model import BuildEstimate


def estimate_lines(e: BuildEstimate) -> list[str]:
    """A short human report (the CLI prints it; Setup shows it before Build)."""
    t = lambda s: f"{s:.1f} s" if s < 60 else f"{s / 60:.1f} min" if s < 3600 else f"{s / 3600:.1f} h"  # noqa: E731
    b = lambda v: f"{v / 1e9:.1f} GB" if v >= 1e8 else f"{v / 1e6:.0f} MB"  # noqa: E731
    where = e.device + (", streamed" if e.stream else "") + (f", {e.workers} Ray workers" if e.workers > 1 else "")
    parts = ", ".join(f"{name} {t(s)}" for name, s in e.parts.items() if s > 0)
    of, cells = f" of {b(e.device_memory)}" if e.device_memory else "", f"; {e.cells:,} distinct cells" if e.cells else ""
    out = [f"predicted {e.estimator} table of {e.model} on {where}: {t(e.seconds)} ({parts})"]
    out.append(f"peak memory: {b(e.device_bytes)} on the device{of}, {b(e.host_bytes)} on the host{cells}")
    if e.fits is False:
        out.append("does not fit the device: add --stream (blocks from the host), fewer/shorter windows, or --ray workers")
    return out + [f"basis: {e.basis}"] + [f"assumes: {note}" for note in e.notes]
