"""Argument types and parsers shared by the ``gap`` subcommands (no torch: the parser stays fast).

A value argparse can check on its own (a rate, an integer) fails at parse time with exit
status 2; a value that needs context (a lock list, a budget) raises a GapError in the
handler, which ``main`` prints as one line and also turns into exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from gap_engine.core.config import BUILTIN_TEXT_NAMES, WindowSpec
from gap_engine.core.deprecation import deprecation_text
from gap_engine.core.device import DeviceError, DeviceSpec, canonical_dtype
from gap_engine.core.errors import BudgetError, OptionError

if TYPE_CHECKING:
    from gap_engine.prune.compensations import CompensationSettings
    from gap_engine.tables.artefact import TableSpec


def rate_arg(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"rate {value} is outside [0, 1)")
    return value


def parse_fraction(text: str, what: str) -> float:
    """A fraction of the prunable parameters in [0, 1), or BudgetError naming ``what``."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise BudgetError(f"{what} must be a number in [0, 1), got '{text}'") from None
    if not 0.0 <= value < 1.0:
        raise BudgetError(f"{what} {value:g} is outside [0, 1): it is a fraction of the prunable parameters")
    return value


def parse_list(text: str, what: str) -> list[str]:
    """Comma-separated items, or BudgetError when there are none."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise BudgetError(f"{what} must be a comma-separated list, got '{text}'")
    return items


def parse_locks(values: list[str] | None) -> dict[int, float]:
    """``["0,29", "5:0.25"]`` -> {0: 0.0, 29: 0.0, 5: 0.25}; a layer alone is locked dense.

    Raises:
        BudgetError: bad syntax, or one layer locked at two different rates.
    """
    locks: dict[int, float] = {}
    for value in values or []:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            layer_text, _, rate_text = item.partition(":")
            try:
                layer = int(layer_text)
                rate = float(rate_text) if rate_text else 0.0
            except ValueError:
                raise BudgetError(f"--lock expects LAYER or LAYER:RATE items separated by commas, got '{item}'") from None
            if layer in locks and locks[layer] != rate:
                raise BudgetError(f"layer {layer} is locked twice, at rates {locks[layer]:g} and {rate:g}")
            locks[layer] = rate
    return locks


def add_window_args(
    p: argparse.ArgumentParser, defaults: WindowSpec, what: str = "calibration", builtins: tuple[str, ...] = BUILTIN_TEXT_NAMES
) -> None:
    """--data, --samples, --seq-len, --seed, --batch-size for one WindowSpec (``builtins``: the
    built-in sources --data may name there: held-out-only ones are never calibration text)."""
    p.add_argument(
        "--data",
        default=defaults.data,
        help=f"{what} text: {', '.join(builtins)}, a .txt/.jsonl file, or an HF spec"
        + (", or several comma-separated: the windows are divided among them in order" if what == "calibration" else "")
        + " (default: %(default)s)",
    )
    p.add_argument("--samples", type=int, default=defaults.n_samples, help=f"{what} windows (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per window (default: %(default)s)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="which windows are drawn (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="windows per forward pass (memory only)")


def windows_from(args: argparse.Namespace, prefix: str = "") -> WindowSpec:
    """The WindowSpec that `add_window_args` options describe (``prefix``: e.g. "eval_")."""
    return WindowSpec(
        data=getattr(args, f"{prefix}data"),
        n_samples=getattr(args, f"{prefix}samples"),
        seq_len=getattr(args, f"{prefix}seq_len"),
        seed=args.seed,
        batch_size=args.batch_size,
    )


def device_arg(text: str) -> str:
    """argparse type: a device name (auto, cpu, cuda, cuda:N, mps); whether it exists is checked later."""
    try:
        DeviceSpec(device=text).validate()
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip().lower()


def dtype_arg(text: str) -> str:
    """argparse type: auto, float32, bfloat16 or float16 (fp32, bf16, fp16 also read)."""
    try:
        DeviceSpec(dtype=text).validate()
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return canonical_dtype(text)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device, --dtype and --stream, for every command that runs a model (one group, reused)."""
    group = p.add_argument_group("device and precision")
    group.add_argument(
        "--device",
        type=device_arg,
        default="auto",
        help="auto (the accelerator when there is one, else cpu), cpu, cuda, cuda:N or mps (default: %(default)s)",
    )
    group.add_argument(
        "--dtype",
        type=dtype_arg,
        default="auto",
        help="auto (bfloat16 on an accelerator, float32 on the CPU), float32, bfloat16 or float16",
    )
    group.add_argument(
        "--stream",
        action="store_true",
        help="keep the model on the host and move one block at a time to the device (models larger than the accelerator)",
    )


def device_from(args: argparse.Namespace) -> DeviceSpec:
    """The DeviceSpec that `add_device_args` options describe (CPU float32 when a command has none)."""
    if not hasattr(args, "device"):
        return DeviceSpec("cpu", "float32")
    return DeviceSpec(device=args.device, dtype=args.dtype, stream=args.stream)


class DeprecatedAlias(argparse.Action):
    """An old flag name that still works and says once, on stderr, which name replaced it."""

    def __init__(self, option_strings, dest, new_name: str, **kwargs):
        self.new_name = new_name
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"gap: warning: {deprecation_text(str(option_string), self.new_name)}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def compensation_from(
    args: argparse.Namespace, criterion: str | None = None, planned: str | None = None, model_type: str | None = None
) -> CompensationSettings:
    """What ``--compensate`` asks the kept units to get after the cut; when not given, the one a
    plan was counted for (``planned``: ``RatePlan.compensation``), else the default for
    ``criterion`` on ``model_type``'s family (``prune.compensations.default_for``: none for one that
    updates the kept columns itself) or, with no criterion (``gap compare``: each plan's own), the
    family's default. ``--fit-samples`` sizes the compensation's windows and ``--fit-weighting`` says how its tokens
    count (OptionError where nothing is fitted after the cut)."""
    from gap_engine.prune.compensations import CompensationSettings, default_for, family_default
    from gap_engine.prune.criteria import is_sequential

    if args.compensate:
        settings = CompensationSettings(mode=args.compensate)
    elif planned is not None and not (criterion and is_sequential(criterion)):
        settings = CompensationSettings(mode=planned)
    else:
        settings = default_for(criterion, model_type) if criterion else CompensationSettings(mode=family_default(model_type))
    settings = _weighted(settings, getattr(args, "fit_weighting", None), model_type)
    samples = getattr(args, "fit_samples", None)
    if samples is None:
        return settings.validate()
    if criterion and is_sequential(criterion):
        raise OptionError(
            f"--fit-samples cannot apply: the units are chosen and updated by {criterion}, which fits on its own windows (--obs-samples)"
        )
    if not settings.active:
        raise OptionError("--fit-samples cannot apply: nothing is compensated after the cut (--compensate none)")
    return replace(settings, samples=samples).validate()


def _weighted(settings: CompensationSettings, weighting: str | None, model_type: str | None) -> CompensationSettings:
    """``settings`` weighed as ``--fit-weighting`` asks (None: as the model family's fits are, where its type is known,
    ``with_family_weighting``); OptionError, before anything loads, where nothing is fitted or the family has no norm
    after its output projections to fit through."""
    from gap_engine.model.adapters import has_output_norms
    from gap_engine.prune.compensations import with_family_weighting

    if weighting is None:
        return settings if model_type is None else with_family_weighting(settings, model_type)
    if not settings.active:
        raise OptionError("--fit-weighting cannot apply: nothing is compensated after the cut (--compensate none)")
    if weighting == "output-norm" and model_type is not None and not has_output_norms(model_type):
        raise OptionError(
            f"--fit-weighting output-norm fits through the norms after o_proj and down_proj, and {model_type} blocks have "
            "none (Gemma 3's post-norms); leave it out or give --fit-weighting tokens"
        )
    return replace(settings, weighting=weighting)


def spec_from_args(args: argparse.Namespace, follows: CompensationSettings | None = None, criterion: str | None = None) -> TableSpec:
    """The TableSpec the table options describe (TableError on bad values): `gap table`, `gap prune
    --budget` and `gap compare`.

    Args:
        follows: the compensation the command applies after the cut (prune, compare): an
            estimator that measures cells measures them with it, so the DP sees what is shipped;
            None (``gap table``): the cells include ``--compensate`` only when it is given.
        criterion: the table's criterion when not ``--criterion`` (``gap prune --criterion obs``, which
            no table can score).
    """
    from gap_engine.tables.artefact import TableSpec, parse_rate_grid  # torch: not at `gap --help` time
    from gap_engine.tables.estimators import ESTIMATORS

    if follows is None:
        compensation = args.compensate or "none"
    else:
        compensation = follows.mode if ESTIMATORS[args.estimator].measures_cells else "none"
    return TableSpec(
        windows=windows_from(args),
        criterion=criterion or args.criterion,
        rate_grid=parse_rate_grid(args.rates),
        objective=args.objective,
        mode=args.mode,
        estimator=args.estimator,
        channel_multiple=args.channel_multiple,
        refine_budgets=parse_rate_grid(args.refine_budgets, "refine budgets"),
        refine_attention=args.refine_attention,
        compensation=compensation,
    ).validate()
