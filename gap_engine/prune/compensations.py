"""The compensations: what surgery does after it cuts, so the kept units take over (the registry).

Structured pruning removes attention heads (columns of ``o_proj``) and MLP channels (columns
of ``down_proj``); the strongest training-free methods then correct the two output
projections in closed form, block by block. Each entry names the function that fits one
projection (``prune.compensate``); ``prune.compensation_pass`` runs them layer-sequentially.

- ``none``: the kept weights as they were.
- ``bias``: FLAP's baseline bias compensation (An et al., AAAI 2024): the removed inputs' mean
  contribution, folded into a bias of ``o_proj`` / ``down_proj``.
- ``refit``: a least-squares refit of the kept columns of ``o_proj`` / ``down_proj`` so the pruned
  block's output matches what its dense weights give on the same inputs (as SlimGPT and
  SlimLLM end their pruning).
- ``bias+refit``: the refit with a free bias.

An entry that ``adds_bias`` gives each ``o_proj`` and ``down_proj`` that lost inputs a bias (the
checkpoint, its remote code and the GGUF export carry it; a plan's budget pays for it); one that
``refits`` solves for the kept columns, so it needs at least as many calibration tokens as the
widest kept input.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gap_engine.core import config
from gap_engine.core.errors import CompensationError
from gap_engine.core.registry import Registry, Strategy
from gap_engine.prune.criteria import is_sequential


@dataclass(frozen=True, kw_only=True)
class Compensation(Strategy):
    """A compensation: ``function`` fits one output projection, ``(moments, weight, kept, damping, what) -> Fit``."""

    adds_bias: bool = False  # gives o_proj/down_proj a bias (parameters the budget pays for)
    refits: bool = False  # solves for the kept columns (second moments of the inputs)


COMPENSATIONS: Registry[Compensation] = Registry(
    "compensation",
    Compensation,
    (
        Compensation("none", "no compensation: the kept weights as they were", "gap_engine.prune.compensate:keep_fit"),
        Compensation(
            "bias", "FLAP's bias: the removed units' mean contribution folded into o_proj/down_proj biases",
            "gap_engine.prune.compensate:bias_fit", adds_bias=True,
        ),
        Compensation(
            "refit", "least-squares refit of the kept o_proj/down_proj columns to the dense block's output",
            "gap_engine.prune.compensate:refit_fit", refits=True,
        ),
        Compensation(
            "bias+refit", "the least-squares refit with a free bias on o_proj/down_proj",
            "gap_engine.prune.compensate:bias_refit_fit", adds_bias=True, refits=True,
        ),
    ),
    CompensationError,
)  # fmt: skip


def fitted_after_cut(criterion: str, mode: str) -> bool:
    """Whether compensation ``mode`` is fitted after a prune by ``criterion`` on windows that can be sized on their
    own (``CompensationSettings.samples``): any mode but none, after a criterion that scores units; OBS fits its
    update and any bias on its own windows."""
    return mode != "none" and not is_sequential(criterion)


def adds_biases(compensation: str | None) -> bool:
    """Whether a plan counted for ``compensation`` (None: for none) pays for the biases it adds."""
    return compensation is not None and COMPENSATIONS[compensation].adds_bias


TARGETS = ("pruned", "dense")  # what a refit matches: see CompensationSettings.target
WEIGHTINGS = ("tokens", "output-norm")  # how calibration tokens count in a fit: see CompensationSettings.weighting
THROUGH_NORMS = " fitted through the output norms"  # how a fit weighted by output norms is named (``fit_name``)


def fit_name(mode: str, weighting: object) -> str:
    """'bias+refit', or 'bias+refit fitted through the output norms' where a fit after the cut counted its tokens
    through the output norms: what runs, records and printed lines call one compensation."""
    return mode + (THROUGH_NORMS if mode != "none" and weighting == "output-norm" else "")


DEFAULT_DAMPING = 0.01


@dataclass(frozen=True)
class CompensationSettings:
    """How the kept units are compensated after surgery."""

    mode: str = config.DEFAULT_COMPENSATION  # a COMPENSATIONS name
    damping: float = DEFAULT_DAMPING  # ridge on the change of the kept weights, relative to the mean input energy
    # "pruned": match the dense weights applied to the pruned model's own inputs (each block
    # fixes its own cut); "dense": match the dense model's outputs on its own inputs (each block
    # also chases the errors of the blocks before it).
    target: str = "pruned"
    # Calibration windows the fit reads: the calibration text's source, length and seed, this many (the first of
    # them the calibration's own); None: the calibration windows themselves. A fit costs one Gram matrix per
    # projection, so it can read more windows than a table's cells do, and a refit solves for as many unknowns per
    # output as the projection has kept inputs: more tokens than the table's 4,096 steady it.
    samples: int | None = None
    # "tokens": every calibration token counts the same (the mean output and the least-squares fit of the projection's
    # output). "output-norm", for families that normalise a projection's output before the residual (Gemma 3's
    # post-norms): each token counts by the inverse mean square of the projection's dense output on it, so the fit
    # minimises the error after the norm (to first order, leaving aside the part along the output) rather than
    # before it, where a few tokens with large outputs would otherwise set a bias every other token receives.
    # None: the model family's (``family_weighting``), settled where the fit meets the model (``with_family_fit``).
    weighting: str | None = None

    def validate(self) -> CompensationSettings:
        """CompensationError (one line) for a value the pass cannot use."""
        COMPENSATIONS.check(self.mode)
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1):
            raise CompensationError(f"compensation windows {self.samples!r}: give a whole number of windows, at least 1")
        if self.samples is not None and self.mode == "none":
            raise CompensationError("compensation none fits nothing: it reads no windows to size")
        if self.weighting not in (None, "tokens") and self.mode == "none":
            raise CompensationError(f"compensation none fits nothing: it has no tokens to weigh ({self.weighting})")
        if self.weighting is not None and self.weighting not in WEIGHTINGS:
            raise CompensationError(f"unknown compensation weighting '{self.weighting}'; choose one of {', '.join(WEIGHTINGS)}")
        if self.target not in TARGETS:
            raise CompensationError(f"unknown compensation target '{self.target}'; choose one of {', '.join(TARGETS)}")
        if isinstance(self.damping, bool) or not isinstance(self.damping, (int, float)) or not (0.0 < float(self.damping) <= 10.0):
            raise CompensationError(f"compensation damping {self.damping!r} is outside (0, 10]")
        return self

    @property
    def active(self) -> bool:
        """Whether anything is compensated (any mode but ``none``)."""
        return self.mode != "none"

    @property
    def adds_bias(self) -> bool:
        """Whether the mode gives each o_proj and down_proj that lost inputs a bias (and so adds parameters)."""
        return COMPENSATIONS[self.mode].adds_bias

    @property
    def weighted(self) -> bool:
        """Whether the fit counts each token through the norms after o_proj and down_proj (``output-norm``); False
        for tokens alike and for a weighting not yet settled (``with_family_fit`` settles it)."""
        return self.active and self.weighting == "output-norm"

    @property
    def name(self) -> str:
        """The compensation as it is printed and compared (``fit_name``)."""
        return fit_name(self.mode, self.weighting)

    @property
    def refits(self) -> bool:
        """Whether the mode solves for the kept columns."""
        return COMPENSATIONS[self.mode].refits

    def to_dict(self) -> dict[str, object]:
        """What a checkpoint, a run and a table record."""
        recorded: dict[str, object] = {"mode": self.mode, "damping": float(self.damping), "target": self.target}
        if self.weighted:  # a record without a weighting weighed tokens alike (as every record before it existed did)
            recorded["weighting"] = self.weighting
        return recorded if self.samples is None else recorded | {"samples": self.samples}


NO_COMPENSATION = CompensationSettings(mode="none")  # surgery alone


def family_default(model_type: object) -> str:
    """The compensation a model type's prunes get by default after a criterion that leaves the kept
    columns as they were: its family's measured choice (``ModelTypeFacts.default_compensation``:
    ``bias+refit`` on Gemma 3), else ``config.DEFAULT_COMPENSATION``. ``model_type``: a
    ``config.model_type`` (None: not known, the general default)."""
    from gap_engine.model.adapters import model_type_facts  # torch: imported when a prune is set up, not by gap --help

    facts = model_type_facts(model_type)
    return facts.default_compensation if facts is not None and facts.default_compensation else config.DEFAULT_COMPENSATION


def fit_window_count(model_type: object, calibration: int, asked: int | None = None) -> int:
    """How many calibration windows a compensation fitted after the cut reads: ``asked``, else the model family's
    floor (``ModelTypeFacts.default_fit_windows``: 64 on Gemma 3) where the calibration's ``calibration`` windows are
    fewer, else the calibration's own."""
    from gap_engine.model.adapters import model_type_facts  # torch: imported when a prune is set up, not by gap --help

    if asked is not None:
        return asked
    facts = model_type_facts(model_type)
    return max(calibration, facts.default_fit_windows if facts is not None else 0)


def family_weighting(model_type: object) -> str:
    """How a model type's fits count their tokens when no weighting is asked: its family's measured choice
    (``ModelTypeFacts.default_fit_weighting``: ``output-norm`` on Gemma 3), else every token alike."""
    from gap_engine.model.adapters import model_type_facts  # torch: imported when a prune is set up, not by gap --help

    facts = model_type_facts(model_type)
    return facts.default_fit_weighting if facts is not None else "tokens"


def with_family_weighting(settings: CompensationSettings, model_type: object) -> CompensationSettings:
    """``settings`` with the model family's weighting (``family_weighting``) where none was asked and something is
    fitted, so it is checked, printed and recorded as if asked for; ``settings`` as they are otherwise."""
    if not settings.active or settings.weighting is not None:
        return settings
    return replace(settings, weighting=family_weighting(model_type))


def with_family_fit(settings: CompensationSettings, model_type: object, calibration: int) -> CompensationSettings:
    """``settings`` with what the model family decides for a fit after the cut spelled out, so it is checked, printed
    and recorded as if asked for: the weighting where none was asked (``with_family_weighting``), and the windows where
    the family's floor (``fit_window_count``) makes them more than the calibration's ``calibration`` and no count was
    asked. ``settings`` as they are where nothing is fitted."""
    if not settings.active:
        return settings
    settings = with_family_weighting(settings, model_type)
    if settings.samples is not None:
        return settings
    count = fit_window_count(model_type, calibration)
    return settings if count == calibration else replace(settings, samples=count)


def default_for(criterion: str, model_type: object = None) -> CompensationSettings:
    """The compensation a command applies when none is asked for: the model family's default
    (`family_default`, its tokens weighed as `family_weighting` says), or none for a criterion that updates the kept columns itself (``obs``:
    SlimGPT's OBS update is its compensation, and it takes no second one)."""
    if is_sequential(criterion):
        return NO_COMPENSATION
    return with_family_weighting(CompensationSettings(mode=family_default(model_type)), model_type)
