"""Rate plans: validation and JSON/YAML round trips."""

from __future__ import annotations

import json

import pytest

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import PlanError
from gap_engine.model.rateplan import RatePlan, make_plan, uniform_plan
from gap_engine.pipeline.stages import prune_with_plan


def test_plan_round_trips_through_json_and_yaml(make_tiny, tmp_path):
    lm = make_tiny("llama")
    plan = make_plan(lm, [0.25, 0.0], [0.5, 0.125], "wanda", allocator="dp", budget=0.2, predicted_loss=0.31)
    for name in ("plan.json", "plan.yaml"):
        path = plan.save(tmp_path / name)
        again = RatePlan.load(path)
        assert again.to_dict() == plan.to_dict()
    assert json.loads((tmp_path / "plan.json").read_text())["format_version"] == 2
    assert plan.params["pruned_total"] < plan.params["dense_total"]
    assert 0 < plan.params["removed_fraction_of_prunable"] < 1


def test_a_version_1_plan_is_read_with_its_method_as_the_allocator(make_tiny):
    plan = make_plan(make_tiny("llama"), [0.25, 0.0], [0.5, 0.125], "wanda", allocator="owl", budget=0.2)
    old = plan.to_dict()
    old["method"] = old.pop("allocator")
    old["format_version"] = 1
    again = RatePlan.from_text(json.dumps(old))
    assert again.allocator == "owl" and again.format_version == 2
    assert again.attention_rates == plan.attention_rates and again.params == plan.params


def test_uniform_plan_removes_about_its_rate(smol):
    plan = uniform_plan(smol, 0.2, "wanda")
    assert plan.params["dense_prunable"] == 106_168_320  # 30 x (attention 884,736 + MLP 2,654,208)
    assert 0.18 < plan.params["removed_fraction_of_prunable"] < 0.24


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_rates": [0.1]}, "must list 2 rates"),
        ({"mlp_rates": [0.1, 1.0]}, r"mlp_rates\[1\] = 1.0 is outside"),
        ({"mlp_rates": [0.1, -0.1]}, "outside"),
        ({"criterion": "psychic; rm"}, "criterion 'psychic; rm' is not a name"),
        ({"compensation": "half bias"}, "compensation 'half bias' is not a name"),
        ({"format_version": 99}, "format version 99"),
        ({"surprise": 1}, "unknown field"),
        ({"attention_shapes": [[2, 2]]}, "must list 2"),
        ({"attention_shapes": [[2, 2], [2]]}, r"attention_shapes\[1\] must be"),
        ({"attention_shapes": [[2, 2], [0, 1]]}, r"attention_shapes\[1\] must be between 1"),
    ],
)
def test_malformed_plans_are_rejected(make_tiny, change, message):
    data = make_plan(make_tiny("llama"), [0.0, 0.0], [0.0, 0.0], "wanda").to_dict()
    data.update(change)
    with pytest.raises(PlanError, match=message):
        RatePlan.from_dict(data)


def test_a_plan_may_name_any_criterion_and_pruning_refuses_one_nobody_registered(make_tiny):
    """A checkpoint pruned by a plugin's criterion loads without the plugin; pruning by it needs it."""
    lm = make_tiny("llama")
    plan = RatePlan.from_dict(make_plan(lm, [0.5, 0.0], [0.25, 0.0], "wanda").to_dict() | {"criterion": "psychic"})
    with pytest.raises(PlanError, match="unknown criterion 'psychic'; choose one of magnitude, wanda"):
        prune_with_plan(lm, plan, WindowSpec(n_samples=2, seq_len=16))


def test_plan_for_another_model_is_rejected(make_tiny):
    plan = make_plan(make_tiny("llama", seed=1), [0.0, 0.0], [0.0, 0.0], "wanda")
    with pytest.raises(PlanError, match="was made for model"):
        plan.check_model(make_tiny("llama", seed=2))
    with pytest.raises(PlanError, match="2 layers, but tiny-llama has 3"):
        plan.check_model(make_tiny("llama", num_hidden_layers=3))


def test_unreadable_plan_files(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan"):
        RatePlan.load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not: [valid")
    with pytest.raises(PlanError, match="is not valid JSON"):
        RatePlan.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(PlanError, match="must be a JSON/YAML object"):
        RatePlan.load(bad)


def test_a_plan_has_one_identity_that_survives_files_and_the_store(make_tiny, tmp_path, monkeypatch):
    from gap_engine.core.errors import CacheError
    from gap_engine.plan import store as planstore

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    lm = make_tiny("llama")
    plan = make_plan(lm, [0.25, 0.0], [0.5, 0.125], "wanda", allocator="dp", budget=0.2, predicted_loss=0.31, table_key="t1")
    digest = plan.content_hash()
    assert len(digest) == 12 and int(digest, 16) >= 0
    remade = make_plan(lm, [0.25, 0.0], [0.5, 0.125], "wanda", allocator="dp", budget=0.2, predicted_loss=0.31, table_key="t1")
    remade.created = "2020-01-01T00:00:00+00:00"
    assert remade.content_hash() == digest  # made again, later: the same plan
    assert RatePlan.load(plan.save(tmp_path / "p.yaml")).content_hash() == digest
    other = make_plan(lm, [0.25, 0.0], [0.5, 0.25], "wanda", allocator="dp", budget=0.2, predicted_loss=0.31, table_key="t1")
    assert other.content_hash() != digest  # one rate differs: another plan

    assert planstore.get_plan(digest) is None
    assert planstore.put_plan(plan, {"locked": {"1": 0.5}, "max_rate": 0.9, "coupled": False}) == digest
    stored, constraints = planstore.get_plan(digest)
    assert stored.to_dict() == plan.to_dict() and constraints["locked"] == {"1": 0.5}
    path = planstore.plan_path(digest)
    data = json.loads(path.read_text())
    data["plan"]["mlp_rates"] = [0.5, 0.25]  # a changed file is not taken for the plan it names
    path.write_text(json.dumps(data))
    with pytest.raises(CacheError, match="was changed"):
        planstore.get_plan(digest)
    with pytest.raises(CacheError, match="not a plan hash"):
        planstore.get_plan("../../etc/passwd")


def test_recorded_attention_shapes_join_the_plans_identity_only_where_recorded(make_tiny):
    lm = make_tiny("llama")
    plan = make_plan(lm, [0.25, 0.0], [0.5, 0.125], "wanda")
    assert "attention_shapes" not in plan.to_dict()  # a plan without them reads and hashes as it did
    digest = plan.content_hash()
    shaped = make_plan(lm, [0.25, 0.0], [0.5, 0.125], "wanda", attention_shapes=[[2, 1], [2, 2]])
    assert shaped.content_hash() != digest
    again = RatePlan.from_text(shaped.to_json(), "plan.json")
    assert again.attention_shapes == [[2, 1], [2, 2]] and again.content_hash() == shaped.content_hash()
