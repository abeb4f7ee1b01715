"""Layer streaming (``--stream``): the same numbers as a resident model, one block at a time.

On the CPU the "device" is the host, so nothing moves, but every streamed code path runs:
the pass-through capture of block calls, the block-major passes, the grouped wavefront of
table cells and its bookkeeping. Tables, importance scores and evaluation numbers must be
*identical* to the resident model's (the same arithmetic on the same inputs, in another
order). Moving a block to another device and back is checked on the ``meta`` device.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch

from gap_engine.core.device import Placement
from gap_engine.core.errors import CancelledError
from gap_engine.core.progress import Hooks, reporting
from gap_engine.evaluate.metrics import compare_logits, mean_nll
from gap_engine.model.layerwise import block_on, capture_calls, forward_blocks
from gap_engine.model.loading import place_model
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.build import measure_table
from gap_engine.tables.exact import measure_exact
from gap_engine.tables.streaming import cell_groups

STREAMED = Placement(device=torch.device("cpu"), dtype=torch.float32, stream=True)
GRID4 = (0.0, 0.25, 0.5, 0.75)


def windows_of(n: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (n, t), generator=torch.Generator().manual_seed(seed))  # (N, T)


def spec_of(**fields) -> TableSpec:
    base = dict(n_samples=3, seq_len=24, rate_grid=GRID4, batch_size=2)
    return TableSpec.from_dict(base | fields)


def pair(make_tiny, family: str):
    """The same tiny model twice: resident, and placed to stream."""
    resident = make_tiny(family, initializer_range=0.2)
    streamed = place_model(resident.copy(), STREAMED)
    return resident, streamed


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.slow
def test_streamed_table_equals_the_resident_table(make_tiny, family):
    resident, streamed = pair(make_tiny, family)
    windows = windows_of(3, 24)
    spec = spec_of()
    expected = measure_table(resident, spec, windows)
    got = measure_table(streamed, spec, windows)  # picks the streamed builder by itself
    assert got.extras["placement"] == "cpu fp32 (streamed)" and "streamed_groups_of" in got.extras
    np.testing.assert_array_equal(got.cell_objective, expected.cell_objective)
    assert got.dense_objective == expected.dense_objective
    np.testing.assert_array_equal(got.removed, expected.removed)
    # Small groups: several sweeps over the blocks, cells of several layers in flight together.
    grouped = measure_table(streamed, spec, windows, cells=functools.partial(measure_exact, per_group=3))
    np.testing.assert_array_equal(grouped.cell_objective, expected.cell_objective)
    assert grouped.extras["streamed_groups_of"] == 3


@pytest.mark.slow
def test_streamed_kl_block_table_equals_the_resident_one(make_tiny):
    resident, streamed = pair(make_tiny, "qwen3")
    windows = windows_of(3, 24, seed=1)
    spec = spec_of(mode="block", objective="kl")
    expected = measure_table(resident, spec, windows)
    got = measure_table(streamed, spec, windows, cells=functools.partial(measure_exact, per_group=2))
    np.testing.assert_array_equal(got.cell_objective, expected.cell_objective)
    assert got.delta[:, 1:].min() > 0


@pytest.mark.slow
def test_streamed_weights_stay_on_the_host_unchanged(make_tiny):
    resident, streamed = pair(make_tiny, "llama")
    before = streamed.fingerprint
    measure_table(streamed, spec_of(), windows_of(3, 24))
    from gap_engine.model.loaded import model_fingerprint

    assert model_fingerprint(streamed.model, streamed.tokenizer) == before == resident.fingerprint


@pytest.mark.parametrize("criterion", ["wanda", "flap"])
@pytest.mark.slow
def test_streamed_importance_scores_equal_the_resident_ones(make_tiny, criterion):
    resident, streamed = pair(make_tiny, "gemma3_text")
    windows = windows_of(4, 24, seed=3)
    expected = compute_importance(resident, windows, criterion, batch_size=3)
    got = compute_importance(streamed, windows, criterion, batch_size=3)
    for a, b in zip(expected.layers, got.layers):
        assert torch.equal(a.head, b.head) and torch.equal(a.channel, b.channel)
        assert b.head.device.type == "cpu" and b.head.dtype == torch.float64


@pytest.mark.slow
def test_streamed_evaluation_equals_the_resident_one(make_tiny):
    resident, streamed = pair(make_tiny, "llama")
    other = make_tiny("llama", initializer_range=0.2, seed=7)
    windows = windows_of(4, 24, seed=4)
    assert mean_nll(streamed, windows, 3) == mean_nll(resident, windows, 3)
    assert compare_logits(streamed, other, windows, 3) == compare_logits(resident, other, windows, 3)


@pytest.mark.parametrize(
    ("family", "estimator", "objective"),
    [("llama", "fisher", "kl"), ("gemma3_text", "fisher", "nll"), ("qwen3", "taylor", "nll")],
)
@pytest.mark.slow
def test_streamed_gradient_estimates_equal_the_resident_ones(make_tiny, family, estimator, objective):
    # A block-by-block backward pass recomputes each block and chains the gradients by hand:
    # the same sums as one backward pass, up to float32 rounding of the order of additions.
    resident, streamed = pair(make_tiny, family)
    windows = windows_of(4, 24, seed=5)
    spec = spec_of(estimator=estimator, objective=objective, n_samples=4)
    expected = measure_table(resident, spec, windows)
    seen = []
    got = measure_table(streamed, spec, windows, Hooks(progress=lambda done, total, eta: seen.append((done, total))))
    assert got.extras["placement"] == "cpu fp32 (streamed)"
    assert np.abs(expected.delta).max() > 1e-4  # the estimate is not trivially zero
    np.testing.assert_allclose(got.cell_objective, expected.cell_objective, rtol=1e-4, atol=1e-6)
    assert got.dense_objective == pytest.approx(expected.dense_objective, rel=1e-6)
    assert seen[-1] == (streamed.num_layers, streamed.num_layers)  # progress counts blocks of the backward pass


@pytest.mark.slow
def test_streamed_refined_table_equals_the_resident_one(make_tiny):
    resident, streamed = pair(make_tiny, "llama")
    windows = windows_of(3, 24, seed=6)
    spec = spec_of(estimator="refine", objective="kl", refine_budgets=(0.2, 0.4))
    expected = measure_table(resident, spec, windows)
    got = measure_table(streamed, spec, windows)
    np.testing.assert_array_equal(got.measured, expected.measured)
    assert 0 < got.measured.sum() < got.measured.size
    np.testing.assert_allclose(got.cell_objective, expected.cell_objective, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_streamed_taylor_scores_equal_the_resident_ones(make_tiny):
    resident, streamed = pair(make_tiny, "gemma3_text")
    windows = windows_of(4, 24, seed=7)
    expected = compute_importance(resident, windows, "taylor", batch_size=3)
    got = compute_importance(streamed, windows, "taylor", batch_size=3)
    for a, b in zip(expected.layers, got.layers):
        torch.testing.assert_close(b.head, a.head, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(b.channel, a.channel, rtol=1e-4, atol=1e-9)
    weights = [w for layer in streamed.adapter.layers(streamed.model) for w in layer.parameters()]
    assert not any(w.requires_grad for w in weights)  # the scores leave the weights as they found them


@pytest.mark.slow
def test_a_cancelled_streamed_build_resumes_in_a_resident_one(make_tiny):
    resident, streamed = pair(make_tiny, "llama")
    windows = windows_of(3, 24)
    spec = spec_of()
    reference = measure_table(resident, spec, windows)

    class Store:
        cells: dict = {}

        def load(self):
            return dict(self.cells)

        def save(self, cells):
            self.cells = dict(cells)

    store, event = Store(), threading.Event()

    def progress(done, total, eta):
        if done >= 3:
            event.set()

    with pytest.raises(CancelledError):
        measure_table(
            streamed,
            spec,
            windows,
            Hooks(progress=progress, cancel=event),
            store,
            cells=functools.partial(measure_exact, per_group=3),
        )
    assert len(store.cells) == 3
    resumed = measure_table(resident, spec, windows, partial=store)
    assert resumed.extras["cells_resumed"] == 3
    np.testing.assert_array_equal(resumed.cell_objective, reference.cell_objective)


def test_cell_groups_follow_the_layers():
    class FakeCut:
        def __init__(self, layer):
            self.layer = layer

    jobs = [(k, 1, FakeCut(layer)) for k, layer in enumerate([3, 0, 2, 0, 1])]
    assert cell_groups(jobs, [0, 1, 2, 3, 4], 2) == [[1, 3], [4, 2], [0]]


def test_block_on_moves_a_block_and_puts_the_host_tensors_back(make_tiny):
    lm = make_tiny("llama")
    layer = lm.adapter.layers(lm.model)[1]
    host = {name: (p, p.data_ptr()) for name, p in layer.named_parameters()}
    with block_on(layer, torch.device("meta")):
        assert all(p.device.type == "meta" for p in layer.parameters())
    for name, p in layer.named_parameters():
        assert p is host[name][0] and p.data_ptr() == host[name][1] and p.device.type == "cpu"


@pytest.mark.slow
def test_capture_records_every_block_call_without_running_blocks(make_tiny):
    lm = make_tiny("gemma3_text")
    ids = windows_of(2, 24)
    embeddings, calls = capture_calls(lm, ids)
    assert embeddings.shape == (2, 24, 64) and len(calls) == 2
    # Gemma 3 alternates sliding and full attention: the two blocks get their own rotary tables.
    cos0, cos1 = calls[0][1]["position_embeddings"][0], calls[1][1]["position_embeddings"][0]
    assert not torch.equal(cos0, cos1)
    assert all("forward" not in vars(layer) for layer in lm.adapter.layers(lm.model))
    seen, told = [], []
    with reporting(Hooks(progress=lambda done, total, eta: told.append((done, total)))):  # the stage it runs under
        out = forward_blocks(lm, ids, 1, on_input=lambda i, hidden: seen.append(i))
    assert seen == [0, 1] and len(out.final_hidden) == 2 and told == [(1, 2), (2, 2)]
