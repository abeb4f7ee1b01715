"""gap never runs a model folder's code: ``model.remote_code``'s policy.

A folder whose config.json or tokenizer_config.json names Python of its own in ``auto_map`` is
refused by every loader (model, tokenizer, the cheap checks commands run first, the cost model's
shape read, a hub snapshot in the local cache), and its Python is never imported: each planted
modeling file writes a marker file when imported, and no test may find the marker. gap's own
checkpoints carry an ``auto_map`` too; it is accepted only beside a modeling file byte-identical
to gap's. Tiny random 2-layer Llama folders with the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gap_engine.core.errors import ModelLoadError
from gap_engine.model.remote_code import MODELING_FILE, MODELING_SOURCE, code_refusal

EVIL_MODULE = "modeling_evil"


def plant_code(folder: Path, marker: Path, where: str = "config.json", model_type: str | None = "evil") -> Path:
    """Make ``folder`` name a module of its own in ``where``'s auto_map; importing it writes ``marker``."""
    (folder / f"{EVIL_MODULE}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
        "class EvilForCausalLM(LlamaForCausalLM):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    path = folder / where
    data = json.loads(path.read_text())
    if where == "config.json":
        if model_type is not None:
            data["model_type"] = model_type
        data["auto_map"] = {"AutoConfig": f"{EVIL_MODULE}.EvilConfig", "AutoModelForCausalLM": f"{EVIL_MODULE}.EvilForCausalLM"}
    else:
        data["tokenizer_class"] = "EvilTokenizer"
        data["auto_map"] = {"AutoTokenizer": [None, f"{EVIL_MODULE}.EvilTokenizer"]}
    path.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smol_tokenizer):
    """A plain transformers folder: a tiny random Llama and the SmolLM2 tokenizer."""
    from conftest import tiny_lm

    folder = tmp_path_factory.mktemp("plain") / "tiny-llama"
    tiny_lm("llama", smol_tokenizer).model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smol_tokenizer):
    """A gap checkpoint of the tiny Llama (its config.json carries gap's own auto_map)."""
    from conftest import tiny_lm

    from gap_engine.core.config import WindowSpec
    from gap_engine.model.checkpoint import save_pruned
    from gap_engine.model.rateplan import uniform_plan
    from gap_engine.pipeline.stages import prune_with_plan

    lm = tiny_lm("llama", smol_tokenizer)
    plan = uniform_plan(lm, 0.5, "magnitude")
    result = prune_with_plan(lm, plan, WindowSpec(n_samples=2, seq_len=16))
    return save_pruned(lm, plan, result.kept_indices(), tmp_path_factory.mktemp("ck") / "tiny-ck")


def copy_of(folder: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(folder, tmp_path / name))


@pytest.fixture
def no_prompt(monkeypatch):
    """Fail the test if anything asks on stdin (transformers' "run the custom code? [y/N]")."""

    def refuse(*_):
        raise AssertionError("a prompt asked for input")

    monkeypatch.setattr("builtins.input", refuse)


CASES = {
    "config auto_map, own model_type": ("config.json", "evil"),
    "config auto_map, a family transformers knows": ("config.json", None),
    "tokenizer_config auto_map": ("tokenizer_config.json", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_folder_naming_its_own_code_is_refused_by_every_loader_and_never_imported(case, tiny_folder, tmp_path, no_prompt):
    from gap_engine.model.loading import check_model_files, load_model, load_tokenizer
    from gap_engine.pipeline.cost_model import model_shape

    where, model_type = CASES[case]
    marker = tmp_path / "MARKER"
    folder = plant_code(copy_of(tiny_folder, tmp_path), marker, where, model_type)
    assert code_refusal(folder, gap_checkpoint=False) == (
        f"its {where} names code of its own in auto_map ({EVIL_MODULE}.{'EvilConfig, ' + EVIL_MODULE + '.EvilForCausalLM' if where == 'config.json' else 'EvilTokenizer'})"
    )
    for load in (check_model_files, load_model, model_shape):
        with pytest.raises(ModelLoadError, match=f"{where} names code of its own in auto_map.*never runs a model folder's code"):
            load(str(folder))
    assert load_tokenizer(folder) is None  # refused too (the model's load then says why)
    assert not marker.exists()


@pytest.mark.slow
def test_a_plain_folder_and_a_gap_checkpoint_pass(tiny_folder, tiny_checkpoint):
    assert code_refusal(tiny_folder, gap_checkpoint=False) is None
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_gap_pruned.GapPrunedLlamaForCausalLM"
    assert code_refusal(tiny_checkpoint, gap_checkpoint=True) is None
    # the same auto_map in a folder that is no gap checkpoint is a folder naming its own code
    assert "config.json names code of its own" in code_refusal(tiny_checkpoint, gap_checkpoint=False)


def _edit_modeling(folder: Path) -> None:
    (folder / MODELING_FILE).write_text((folder / MODELING_FILE).read_text() + "\nimport os  # one more line\n")


def _link_modeling(folder: Path) -> None:
    from gap_engine.model.remote_code import MODELING_SOURCE

    (folder / MODELING_FILE).unlink()
    (folder / MODELING_FILE).symlink_to(MODELING_SOURCE)  # the same bytes today, whatever the link points at tomorrow


def _other_module(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "evil.GapPrunedLlamaForCausalLM"
    (folder / "config.json").write_text(json.dumps(config))


def _tokenizer_code(folder: Path) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.Slow", "evil.Fast"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


CHECKPOINT_EDITS = {
    "modeling file edited": (_edit_modeling, "modeling_gap_pruned.py is not gap's own"),
    "modeling file a link": (_link_modeling, "modeling_gap_pruned.py is not gap's own"),
    "modeling file missing": (lambda d: (d / MODELING_FILE).unlink(), "modeling_gap_pruned.py is not gap's own"),
    "auto_map names another module": (_other_module, "config.json names code of its own in auto_map (evil.GapPruned"),
    "tokenizer auto_map": (_tokenizer_code, "tokenizer_config.json names code of its own in auto_map (evil.Fast, evil.Slow)"),
}


@pytest.mark.parametrize("edit", list(CHECKPOINT_EDITS))
def test_a_gap_checkpoint_whose_code_is_not_ours_is_refused(edit, tiny_checkpoint, tmp_path, no_prompt):
    from gap_engine.model.loading import check_model_files, load_model

    change, message = CHECKPOINT_EDITS[edit]
    folder = copy_of(tiny_checkpoint, tmp_path)
    change(folder)
    assert message in code_refusal(folder, gap_checkpoint=True)
    for load in (check_model_files, load_model):
        with pytest.raises(ModelLoadError, match="never runs a model folder's code"):
            load(str(folder))


def test_a_foreign_config_with_values_gaps_own_files_refuse_is_still_read_for_code(tiny_folder, tmp_path):
    """A 31-digit model_max_length (real tokenizer configs hold one) must not hide an auto_map."""
    folder = plant_code(copy_of(tiny_folder, tmp_path), tmp_path / "MARKER", "tokenizer_config.json")
    text = (folder / "tokenizer_config.json").read_text()
    (folder / "tokenizer_config.json").write_text(text[:-1] + ', "model_max_length": 1000000000000000019884624838656}')
    assert "tokenizer_config.json names code of its own" in code_refusal(folder, gap_checkpoint=False)


def test_a_hub_snapshot_in_the_local_cache_naming_its_own_code_is_refused(tiny_folder, tmp_path, monkeypatch, no_prompt):
    import huggingface_hub.constants

    from gap_engine.model.loading import load_model

    marker = tmp_path / "MARKER"
    repo = tmp_path / "hub" / "models--someone--evil"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_folder, snapshot)
    plant_code(snapshot, marker)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="config.json names code of its own in auto_map"):
        load_model("someone/evil", hub=False)
    assert not marker.exists()


def test_no_load_can_prompt_once_the_policy_has_run(tiny_folder, tmp_path, no_prompt):
    """A transformers load that forgets trust_remote_code (a library's own) refuses at once instead of asking."""
    from transformers import AutoConfig

    from gap_engine.model.remote_code import forbid_code_prompts

    marker = tmp_path / "MARKER"
    folder = plant_code(copy_of(tiny_folder, tmp_path), marker)
    forbid_code_prompts()
    with pytest.raises(ValueError, match="custom code"):
        AutoConfig.from_pretrained(str(folder))
    assert not marker.exists()


# sha256 of gap_engine/model/modeling_gap_pruned.py as every checkpoint saved so far carries it.
SHIPPED_MODELING_SHA256 = "360ca049ae93554af1427a84438da444faa8a90449c4006f13b7938096f33ecc"


def test_the_shipped_modeling_file_is_unchanged_so_saved_checkpoints_still_load():
    """A checkpoint's modeling file must equal this version's byte for byte (it is the only code gap lets a checkpoint
    name), so any edit to it, a comment included, refuses every checkpoint saved before. Change it only with a way to
    accept the earlier versions' bytes, then update the hash here."""
    import hashlib

    assert hashlib.sha256(MODELING_SOURCE.read_bytes()).hexdigest() == SHIPPED_MODELING_SHA256
