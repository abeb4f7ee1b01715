"""Evaluation spread over several devices (``--device-map``, accelerate): the same numbers.

No machine here has two GPUs, so the path is proven with what accelerate does on one host:
blocks mapped to 'disk' are offloaded to a folder and hooks bring their weights in for each
forward, exactly as blocks mapped to a second GPU get their inputs moved there. The numbers
must equal the resident model's: only where the weights sit changes.
"""

from __future__ import annotations

import json

import pytest
import torch

from gap_engine.cli import main
from gap_engine.core.device import DeviceError, input_device
from gap_engine.evaluate.metrics import compare_logits, mean_nll
from gap_engine.model.dispatch import describe_device_map, dispatch_lm, parse_max_memory, plan_device_map


def windows_of(n: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (n, t), generator=torch.Generator().manual_seed(seed))  # (N, T)


def test_a_cpu_only_machine_maps_everything_to_the_cpu(make_tiny):
    lm = make_tiny("llama", initializer_range=0.2)
    device_map = plan_device_map(lm, "auto")
    assert set(device_map.values()) == {"cpu"}
    with pytest.raises(DeviceError, match="unknown device map 'everywhere'"):
        plan_device_map(lm, "everywhere")


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.slow
def test_blocks_offloaded_to_disk_give_the_resident_numbers(make_tiny, family, tmp_path):
    resident = make_tiny(family, initializer_range=0.2)
    other = make_tiny(family, initializer_range=0.2, seed=7)
    windows = windows_of(3, 24, seed=2)
    expected_nll, expected_cmp = mean_nll(resident, windows, 2), compare_logits(resident, other, windows, 2)
    spread = resident.copy()
    decoder = spread.model.model
    # Whole blocks, block 1 on disk: accelerate's hooks load its weights for every forward.
    device_map = {f"model.{name}": "cpu" for name, _ in decoder.named_children() if name != "layers"} | {"lm_head": "cpu"}
    for i in range(len(decoder.layers)):
        device_map[f"model.layers.{i}"] = "disk" if i == 1 else "cpu"
    with pytest.raises(DeviceError, match="give --offload-dir"):
        dispatch_lm(spread.copy(), device_map, None)
    dispatch_lm(spread, device_map, tmp_path / "offload")
    assert (tmp_path / "offload" / "index.json").is_file()
    assert spread.adapter.layers(spread.model)[1].mlp.down_proj.weight.device.type == "meta"  # really not in memory
    assert input_device(spread.model).type == "cpu"
    assert "disk: 1 module" in describe_device_map(device_map)
    assert mean_nll(spread, windows, 2) == expected_nll
    assert compare_logits(spread, other, windows, 2) == expected_cmp


def test_max_memory_is_parsed_for_accelerate():
    assert parse_max_memory("cuda:0=70GiB, cuda:1=60GiB,cpu=200GiB") == {0: "70GiB", 1: "60GiB", "cpu": "200GiB"}
    assert parse_max_memory("cuda=10GB") == {0: "10GB"} and parse_max_memory(None) is None
    for bad, message in (("cuda:0", "is not DEVICE=SIZE"), ("tpu=1GB", "unknown device 'tpu'"), ("cuda:x=1GB", "is not cuda or cuda:N")):
        with pytest.raises(DeviceError, match=message):
            parse_max_memory(bad)


@pytest.mark.slow
def test_gap_eval_with_a_device_map_gives_the_same_numbers(tmp_path, capsys):
    small = ["--data", "wiki-sample", "--samples", "2", "--seq-len", "48", "--generations", "0", "--no-throughput", "--json"]
    assert main(["eval", "--model", "smollm2-135m", *small]) == 0
    plain = json.loads(capsys.readouterr().out)
    # Half the model's bytes for the host: accelerate sends the other blocks to the offload folder.
    argv = [
        "eval",
        "--model",
        "smollm2-135m",
        "--device-map",
        "sequential",
        "--max-memory",
        "cpu=300MB",
        "--offload-dir",
        str(tmp_path / "off"),
    ]
    assert main(argv + small) == 0
    spread = json.loads(capsys.readouterr().out)
    assert (tmp_path / "off" / "model" / "index.json").is_file()
    assert spread["perplexity"] == plain["perplexity"]
    assert main(["eval", "--model", "smollm2-135m", "--device-map", "auto", "--stream", *small]) == 2
    assert "leave out --device and --stream" in capsys.readouterr().err
