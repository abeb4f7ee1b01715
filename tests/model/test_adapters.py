"""What each model family's adapter says of its model types, checked against the code that acts on it."""

from __future__ import annotations

import pytest

from gap_engine.model import modeling_gap_pruned
from gap_engine.model.adapters import ADAPTERS, MODEL_TYPES, model_type_facts, supported_model_types


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_model_type_names_remote_classes_the_shipped_modeling_file_defines(model_type):
    facts = model_type_facts(model_type)
    assert facts is not None and facts.name == model_type and model_type in ADAPTERS[model_type].model_types
    config_name, model_name = facts.remote_classes
    config_class, model_class = getattr(modeling_gap_pruned, config_name), getattr(modeling_gap_pruned, model_name)
    # auto_map finds them by module-level name; each must build this model type, from its own config class.
    assert config_class.__name__ == config_name and model_class.__name__ == model_name
    assert config_class.model_type == model_type and model_class.config_class is config_class


def test_a_model_type_no_adapter_serves_has_no_facts():
    # config.json is read from a user's folder: its model_type may be anything, an unhashable list included.
    assert [model_type_facts(t) for t in ("phi", None, ["llama"], 3)] == [None] * 4
    assert sorted(MODEL_TYPES) == supported_model_types()
