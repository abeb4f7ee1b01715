"""A pruned checkpoint written again in another storage precision (``gap export --format hf``).

The source is loaded (and so verified: widths, tensors, fingerprint) with gap's own loader
in float32, then saved with ``checkpoint.save_pruned`` in the asked precision. The plan,
kept indices and any saved evaluation report travel along; the model card is written afresh.
"""

from __future__ import annotations

from pathlib import Path

from gap_engine.core.config import DEFAULT_SAVE_DTYPE
from gap_engine.core.errors import ExportError, OutputError
from gap_engine.core.fsutil import check_not_an_input
from gap_engine.core.validate import read_kept_indices
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import RatePlan
from gap_engine.model.storage import parse_dtype, read_eval_report


def resave_checkpoint(source: str | Path, out_dir: str | Path, dtype: str = DEFAULT_SAVE_DTYPE) -> Path:
    """Load a pruned checkpoint (verifying it) and write it again in ``dtype``.

    Args:
        source: a gap checkpoint folder.
        out_dir: the new folder (replaced atomically); not ``source`` itself.
        dtype: storage precision, one of config.SAVE_DTYPES.
    Returns:
        ``out_dir``.
    Raises:
        ModelLoadError: ``source`` is not a readable, consistent gap checkpoint.
        ExportError: ``out_dir`` is ``source`` or cannot be written, or the dtype is unknown.
    """
    parse_dtype(dtype)
    source, out_dir = Path(source), Path(out_dir)
    try:
        check_not_an_input(out_dir, [("the checkpoint", source)], folder=True, what="the output folder")
    except OutputError as exc:
        raise ExportError(str(exc)) from None
    kept = read_kept_indices(source, ExportError)  # before the slow load
    lm = load_model(str(source))
    if lm.pruned_from is None or lm.pruned_from.get("plan") is None:
        raise ExportError(f"{source} is not a gap checkpoint with a plan.json; only those can be re-saved")
    plan = RatePlan.from_dict(lm.pruned_from["plan"])
    try:
        return save_pruned(lm, plan, kept, out_dir, dtype=dtype, eval_report=read_eval_report(source))
    except OSError as exc:
        raise ExportError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
