"""A model several threads run (the explorer's dense model, ``LoadedModel.shared``) is never
hooked, masked or sliced: the engine's operations that would do so work on a private copy, or
refuse an in-place change, so no caller has to remember to copy it. Tiny model."""

from __future__ import annotations

import pytest
import torch
from synthetic_tables import synthetic_table
from torch import nn

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import SharedModelError
from gap_engine.data.windows import calibration_windows
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.model.loaded import model_fingerprint
from gap_engine.model.rateplan import make_plan
from gap_engine.pipeline.runs import baseline_rows, prune_and_evaluate
from gap_engine.pipeline.stages import loss_table, pruned_as_saved
from gap_engine.plan.allocators import plan_from_table
from gap_engine.plan.evo import EvoSettings
from gap_engine.prune.importance import compute_importance, input_statistics
from gap_engine.prune.surgery import apply_plan, masked_plan
from gap_engine.tables.artefact import TableSpec

WINDOWS = WindowSpec("news-sample", n_samples=2, seq_len=16, batch_size=2)
HOOKS = ("register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook")


@pytest.fixture
def shared(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    lm = make_tiny("llama")
    lm.shared = True
    return lm


def untouched_by(lm, run) -> None:
    """Run ``run()`` and check it registered no hook on ``lm``'s modules and wrote into none of its weights."""
    ours = {id(module) for module in lm.model.modules()}
    hooked: list[str] = []
    params = dict(lm.model.named_parameters())
    versions = {name: p._version for name, p in params.items()}  # bumped by every in-place write
    fingerprint = lm.fingerprint
    with pytest.MonkeyPatch.context() as patch:
        for name in HOOKS:
            real = getattr(nn.Module, name)

            def spy(self, *args, _real=real, _name=name, **kwargs):
                if id(self) in ours:
                    hooked.append(f"{_name} on {type(self).__name__}")
                return _real(self, *args, **kwargs)

            patch.setattr(nn.Module, name, spy)
        run()
    assert hooked == []
    assert {name: id(p) for name, p in lm.model.named_parameters()} == {name: id(p) for name, p in params.items()}  # none swapped out
    assert {name: p._version for name, p in params.items()} == versions
    assert model_fingerprint(lm.model, lm.tokenizer) == fingerprint == lm.fingerprint and lm.pruned_from is None


@pytest.mark.slow
def test_tables_scores_and_allocators_work_on_a_private_copy(shared):
    ids = calibration_windows(shared.tokenizer, WINDOWS)
    table = synthetic_table(shared, data=WINDOWS.data)

    def run():
        for estimator in ("exact", "fisher"):
            loss_table(shared, TableSpec(windows=WINDOWS, rate_grid=(0.0, 0.5), estimator=estimator), use_cache=False)
        for criterion in ("wanda", "taylor"):
            compute_importance(shared, ids, criterion, 2)
        for allocator in ("flap", "owl", "evo"):
            plan_from_table(shared, table, 0.3, allocator, windows=ids, evo=EvoSettings(generations=1, offspring=2))
        baseline_rows(shared, table, [0.3], ["flap", "owl"])

    untouched_by(shared, run)


@pytest.mark.slow
def test_pruning_a_shared_model_prunes_a_copy(shared, tmp_path):
    table = synthetic_table(shared, data=WINDOWS.data)
    plan = make_plan(shared, [0.5, 0.0], [0.25, 0.5], "wanda")
    settings = EvalSettings(windows=WINDOWS, throughput=False, generations=0)
    pruned = []

    def run():
        pruned.append(pruned_as_saved(shared, plan, WINDOWS, keep_dense=False)[0])  # not even when asked: it is shared
        prune_and_evaluate(shared, settings, table=table, budget=0.3, allocator="flap", history_path=tmp_path / "runs.db")

    untouched_by(shared, run)
    assert pruned[0] is not shared and pruned[0].param_count() == pruned[0].pruned_from["plan"]["params"]["pruned_total"]


def test_in_place_changes_of_a_shared_model_are_refused(shared):
    plan = make_plan(shared, [0.5, 0.0], [0.25, 0.5], "magnitude")
    scores = compute_importance(shared, None, "magnitude")
    layer = shared.adapter.layers(shared.model)[0]
    with pytest.raises(SharedModelError, match="surgery would change"):
        apply_plan(shared, plan, scores)
    with pytest.raises(SharedModelError, match="masking"), masked_plan(shared, plan.attention_rates, plan.mlp_rates, scores, 8):
        pass
    with pytest.raises(SharedModelError, match="activation statistics"):
        input_statistics(shared, torch.zeros(1, 4, dtype=torch.long), {"q": shared.adapter.attention_projections(layer)[0]})
    private = shared.private()
    assert private is not shared and not private.shared and private.fingerprint == shared.fingerprint
    assert private.private() is private
