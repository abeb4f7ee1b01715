"""The rate plan: a validated, versioned declaration of how much to prune where.

A plan says, per block and per component (attention, MLP), what fraction of that
component's parameters to remove. Where a rate alone could name either of two attention
shapes with one parameter count (``units``: a tie), a plan made from a pruned model's widths
(iterative planning) records each block's shape too, so applying it always gives those widths. It records the model it was made for (name, weight
fingerprint, layer count), the within-layer criterion, and the parameter counts the plan
produces, so ``surgery`` can check its result against them. Plans round-trip through JSON
and YAML; executing one is ``surgery.apply_plan``'s job, not this module's.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gap_engine.core.config import DEFAULT_CHANNEL_MULTIPLE
from gap_engine.core.deprecation import warn_deprecated
from gap_engine.core.errors import PlanError
from gap_engine.core.fsutil import atomic_write_text
from gap_engine.core.jsontext import json_text
from gap_engine.core.limits import LIMITS, check_file_size
from gap_engine.core.validate import (
    check_int,
    check_keys,
    check_number,
    check_text,
    decode_text,
    parse_json_or_yaml,
    read_bounded,
)
from gap_engine.core.validate_meaning import check_plan_params
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.units import AttentionShape, added_bias_params, block_geometries, channels_for_rate

# Version 2 renamed the field "method" to "allocator"; version-1 plans are read and upgraded.
PLAN_FORMAT_VERSION = 2


@dataclass
class RatePlan:
    model: str  # model name or path the plan was made for
    model_fingerprint: str | None  # weights fingerprint; None accepts any model with this layer count
    num_layers: int  # blocks in the model
    criterion: str  # within-layer importance criterion
    attention_rates: list[float]  # per block: fraction of attention parameters to remove, in [0, 1)
    mlp_rates: list[float]  # per block: fraction of MLP parameters to remove, in [0, 1)
    channel_multiple: int = DEFAULT_CHANNEL_MULTIPLE  # MLP widths are kept in multiples of this
    params: dict[str, Any] = field(default_factory=dict)  # dense/pruned totals as predicted from the geometry
    allocator: str = "manual"  # how the rates were chosen (dp, uniform, flap, owl, evo, manual)
    budget: float | None = None  # requested fraction of prunable parameters to remove
    predicted_loss: float | None = None  # the table's predicted summed loss increase
    table_key: str | None = None  # cache key of the loss table behind a dp plan
    # Per block [KV groups, query heads per group] kept, where they were reached, not rounded
    # from the rate (iterative plans); each has the parameter count its rate rounds to. None: the rates say it.
    attention_shapes: list[list[int]] | None = None
    # The compensation the plan was counted for (a prune.compensations name): where it adds
    # biases the budget paid for them and ``params`` counts them. None: counted
    # without (plans written before this field, hand-written ones).
    compensation: str | None = None
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    format_version: int = PLAN_FORMAT_VERSION

    # ---- validation ------------------------------------------------------------------
    def validate(self) -> RatePlan:
        if self.format_version != PLAN_FORMAT_VERSION:
            raise PlanError(f"plan format version {str(self.format_version)[:20]} is not supported (expected {PLAN_FORMAT_VERSION})")
        check_int(self.num_layers, "plan num_layers", PlanError, 1, LIMITS.layers)
        self._validate_metadata()
        for name in ("attention_rates", "mlp_rates"):
            rates = getattr(self, name)
            if not isinstance(rates, list) or len(rates) != self.num_layers:
                got = len(rates) if isinstance(rates, list) else type(rates).__name__
                raise PlanError(f"plan {name} must list {self.num_layers} rates, got {got}")
            for i, r in enumerate(rates):
                if not isinstance(r, (int, float)) or isinstance(r, bool) or not (0.0 <= float(r) < 1.0):
                    raise PlanError(f"plan {name}[{i}] = {r!r} is outside [0, 1)")
            setattr(self, name, [float(r) for r in rates])
        _check_name(self.criterion, "criterion")
        check_int(self.channel_multiple, "plan channel_multiple", PlanError, 1, LIMITS.channel_multiple)
        if self.attention_shapes is not None:
            self.attention_shapes = self._validated_shapes(self.attention_shapes)
        if self.compensation is not None:
            _check_name(self.compensation, "compensation")
        return self

    def _validated_shapes(self, shapes: object) -> list[list[int]]:
        if not isinstance(shapes, list) or len(shapes) != self.num_layers:
            raise PlanError(f"plan attention_shapes must list {self.num_layers} [KV groups, heads per group] pairs")
        out = []
        for i, shape in enumerate(shapes):
            if not isinstance(shape, list) or len(shape) != 2:
                raise PlanError(f"plan attention_shapes[{i}] must be [KV groups, query heads per group]")
            out.append([check_int(n, f"plan attention_shapes[{i}]", PlanError, 1, LIMITS.layers) for n in shape])
        return out

    def attention_shape(self, index: int) -> AttentionShape | None:
        """Block ``index``'s recorded attention shape, or None where its rate says it."""
        if self.attention_shapes is None:
            return None
        kv_groups, heads_per_group = self.attention_shapes[index]
        return AttentionShape(kv_groups, heads_per_group)

    def _validate_metadata(self) -> None:
        """Types and sizes of the descriptive fields: short single-line texts, finite numbers.

        A plan is read from files and uploads; a field holding a huge or nested value (a YAML
        alias bomb in ``model``) would be copied and written into every checkpoint made from it.
        """
        for name, optional in (
            ("model", False),
            ("model_fingerprint", True),
            ("criterion", False),
            ("allocator", False),
            ("table_key", True),
            ("compensation", True),
            ("created", False),
        ):
            check_text(getattr(self, name), f"plan {name}", PlanError, optional=optional)
        if self.budget is not None:
            check_number(self.budget, "plan budget", PlanError, 0.0, 1.0)
        if self.predicted_loss is not None:
            check_number(self.predicted_loss, "plan predicted_loss", PlanError)
        check_keys(self.params, "plan params", PlanError)
        if len(self.params) > 32:
            raise PlanError(f"plan params must hold at most 32 counts, got {len(self.params)}")
        for key, value in self.params.items():
            check_text(key, "plan params key", PlanError, max_len=64)
            check_number(value, f"plan params {key}", PlanError)
        check_plan_params(self.params, PlanError)  # counts that agree with each other (validate_meaning)

    def check_model(self, lm: LoadedModel) -> None:
        """PlanError unless this plan was made for ``lm`` (layer count, and fingerprint when
        recorded) and its recorded attention shapes fit ``lm``'s blocks, each with the parameter
        count its rate rounds to (a shape only settles a tie the rate leaves open)."""
        if self.num_layers != lm.num_layers:
            raise PlanError(f"plan is for a model with {self.num_layers} layers, but {lm.name} has {lm.num_layers}")
        if self.model_fingerprint and self.model_fingerprint != lm.fingerprint:
            raise PlanError(
                f"plan was made for model '{self.model}' (fingerprint {self.model_fingerprint}), "
                f"not for '{lm.name}' (fingerprint {lm.fingerprint})"
            )
        for i, (counts, rate) in enumerate(zip(block_geometries(lm), self.attention_rates)):
            shape = self.attention_shape(i)
            geom = counts.geometry
            if shape is None:
                continue
            named = f"plan attention_shapes[{i}] = [{shape.kv_groups}, {shape.heads_per_group}]"
            if shape.kv_groups > geom.n_kv_heads or shape.heads_per_group > geom.group_size:
                raise PlanError(f"{named} does not fit {lm.name}'s {geom.n_kv_heads} KV groups of {geom.group_size} heads")
            if counts.attention_params_of(shape) != counts.attention_params_at(rate):
                raise PlanError(f"{named} does not have the size its attention rate {rate:g} rounds to")

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``attention_shapes`` and ``compensation`` only where recorded (a plan without them reads as before)."""
        data = asdict(self)
        for name in ("attention_shapes", "compensation"):
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: object) -> RatePlan:
        if not isinstance(data, dict):
            raise PlanError("a plan must be a JSON/YAML object")
        check_keys(data, "plan", PlanError)
        if data.get("format_version") == 1:
            if "method" in data:
                warn_deprecated('a version-1 plan\'s field "method"', '"allocator" (gap plan writes version 2)')
            data = {("allocator" if k == "method" else k): v for k, v in data.items()} | {"format_version": PLAN_FORMAT_VERSION}
        data = {"model_fingerprint": None} | data  # a hand-written plan may leave it out: any weights
        known = set(cls.__dataclass_fields__)
        missing = [k for k in ("model", "num_layers", "criterion", "attention_rates", "mlp_rates") if k not in data]
        if missing:
            raise PlanError(f"plan is missing the field(s): {', '.join(missing)}")
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"plan has unknown field(s): {', '.join(unknown)}")
        return cls(**data).validate()

    def to_json(self) -> str:
        return json_text(self.to_dict(), "plan", indent=2) + "\n"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_text(cls, text: str, hint: str = "plan") -> RatePlan:
        """A plan from JSON or YAML text (``hint``: the file or upload name; its suffix picks the syntax).

        YAML aliases and nesting deeper than a few levels are refused (see ``validate``).
        """
        if len(text) > LIMITS.plan_bytes:
            check_file_size(len(text.encode("utf-8")), LIMITS.plan_bytes, hint, PlanError)
        return cls.from_dict(parse_json_or_yaml(text, hint, PlanError, name=hint))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        text = self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json()
        return atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | Path) -> RatePlan:
        path = Path(path)
        text = decode_text(read_bounded(path, LIMITS.plan_bytes, f"plan {path}", PlanError), f"plan {path}", PlanError)
        return cls.from_text(text, hint=str(path))

    def rates(self, component: str) -> list[float]:
        return self.attention_rates if component == "attn" else self.mlp_rates

    def content_hash(self) -> str:
        """The plan's identity: 12 hex digits of a SHA-256 over what it prunes and claims.

        Covers the model, rates, criterion, channel multiple, allocator, budget, predicted
        loss, table key, and the attention shapes and compensation where recorded; leaves out ``created`` (the same plan made twice is the same
        plan) and ``params`` (counted from the geometry, so fixed by the rest). A plan file,
        a run and a checkpoint made from one plan show the same hash.
        """
        identity = {name: getattr(self, name) for name in PLAN_IDENTITY_FIELDS}
        for name in ("attention_shapes", "compensation"):  # only where recorded: hashes of plans without them stay
            if getattr(self, name) is not None:
                identity[name] = getattr(self, name)
        text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=float)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:PLAN_HASH_DIGITS]


PLAN_HASH_DIGITS = 12
PLAN_IDENTITY_FIELDS = (
    "model", "model_fingerprint", "num_layers", "criterion", "attention_rates", "mlp_rates",
    "channel_multiple", "allocator", "budget", "predicted_loss", "table_key",
)  # fmt: skip


def plan_hash(data: dict[str, Any]) -> str:
    """`RatePlan.content_hash` of a plan dict (validated first).

    Raises:
        PlanError: ``data`` is not a valid plan.
    """
    return RatePlan.from_dict(dict(data)).content_hash()


def predicted_params(
    lm: LoadedModel,
    attention_rates: Sequence[float],
    mlp_rates: Sequence[float],
    channel_multiple: int = DEFAULT_CHANNEL_MULTIPLE,
    biases: bool = False,
) -> dict[str, Any]:
    """Parameter counts a plan produces, from the geometry alone.

    ``removed`` and ``pruned_total`` are surgery's (what the cut removes and leaves); with
    ``biases`` (a compensation that adds them) also ``bias_params``, what its biases add back
    (`units.added_bias_params`), and ``pruned_total_with_biases``, the model it ships.
    """
    geoms = block_geometries(lm)
    dense_prunable = sum(g.params_at("attn", 0.0) + g.params_at("mlp", 0.0, channel_multiple) for g in geoms)
    pruned_prunable = sum(
        g.params_at("attn", a) + g.params_at("mlp", m, channel_multiple) for g, a, m in zip(geoms, attention_rates, mlp_rates)
    )
    dense_total = lm.param_count()
    removed = dense_prunable - pruned_prunable
    params: dict[str, Any] = {
        "dense_total": dense_total,
        "dense_prunable": dense_prunable,
        "pruned_prunable": pruned_prunable,
        "pruned_total": dense_total - removed,
        "removed": removed,
        "removed_fraction_of_prunable": removed / dense_prunable,
        "removed_fraction_of_total": removed / dense_total,
    }
    if biases:
        added = added_bias_params(geoms, attention_rates, mlp_rates, channel_multiple)
        params |= {"bias_params": added, "pruned_total_with_biases": dense_total - removed + added}
    return params


def _check_name(name: object, field_name: str) -> None:
    """PlanError unless ``name`` has the form of a strategy's name; which names exist is the
    prune stage's to check (``prune.criteria``, ``prune.compensations``: plugins add some)."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+:-]{0,39}", name):
        raise PlanError(f"plan {field_name} {str(name)[:40]!r} is not a name (letters, digits and _.+:- only)")


def plan_params(lm: LoadedModel, plan: RatePlan, biases: bool = False) -> dict[str, Any]:
    """`predicted_params` of ``plan`` on ``lm``; ``biases``: its compensation adds them
    (``prune.compensations.adds_biases(plan.compensation)``), and they are counted."""
    return predicted_params(lm, plan.attention_rates, plan.mlp_rates, plan.channel_multiple, biases)


def make_plan(
    lm: LoadedModel,
    attention_rates: Iterable[float],
    mlp_rates: Iterable[float],
    criterion: str,
    channel_multiple: int = DEFAULT_CHANNEL_MULTIPLE,
    biases: bool = False,
    **meta: Any,
) -> RatePlan:
    """A validated plan for ``lm`` with its predicted parameter counts filled in (``biases``: those its
    compensation adds counted too, ``prune.compensations.adds_biases``)."""
    plan = RatePlan(
        model=lm.name,
        model_fingerprint=lm.fingerprint,
        num_layers=lm.num_layers,
        criterion=criterion,
        attention_rates=[float(r) for r in attention_rates],
        mlp_rates=[float(r) for r in mlp_rates],
        channel_multiple=channel_multiple,
        **meta,
    ).validate()
    if plan.attention_shapes is not None:
        plan.check_model(lm)  # the shapes fit the blocks, each the size of its rate
    plan.params = plan_params(lm, plan, biases)
    return plan


def plan_widths(lm: LoadedModel, plan: RatePlan) -> list[dict[str, int]]:
    """Per block, the widths ``plan`` gives ``lm`` (the form of ``slicing.layer_widths``):
    query and KV heads of its recorded shape or of its rate's, and the MLP channels of its rate."""
    widths = []
    for i, counts in enumerate(block_geometries(lm)):
        shape = plan.attention_shape(i) or counts.attention_shape_at(plan.attention_rates[i])
        channels = channels_for_rate(counts.geometry.intermediate_size, plan.mlp_rates[i], plan.channel_multiple)
        widths.append({"num_attention_heads": shape.n_heads, "num_key_value_heads": shape.kv_groups, "intermediate_size": channels})
    return widths


def uniform_plan(
    lm: LoadedModel,
    rate: float,
    criterion: str,
    channel_multiple: int = DEFAULT_CHANNEL_MULTIPLE,
    compensation: str | None = None,
    biases: bool = False,
) -> RatePlan:
    """Every block and component at the same rate (the baseline most pruners use); ``compensation``:
    the one it will be pruned with, recorded; ``biases``: it adds biases, which its counts then include."""
    if not (0.0 <= rate < 1.0):
        raise PlanError(f"rate {rate} is outside [0, 1)")
    n = lm.num_layers
    return make_plan(
        lm, [rate] * n, [rate] * n, criterion, channel_multiple, biases, allocator="uniform", budget=rate, compensation=compensation
    )
