"""Table cells on Ray workers (``--ray``): the same table as one process, through lost workers.

One local Ray instance for the module (2 worker CPUs, no dashboard, started by the test
itself; nothing leaves the machine). Tiny 4-layer models keep each build to seconds; the
worker processes are kept between builds, as in the app, so only the kills start new ones.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import ray
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import CancelledError
from gap_engine.core.progress import Hooks
from gap_engine.pipeline.stages import loss_table
from gap_engine.tables import cache
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.build import measure_table
from gap_engine.tables.distributed import RayCells, RaySettings, layer_ranges, start_ray

GRID = (0.0, 0.25, 0.5, 0.75)


@pytest.fixture(scope="module")
def local_ray():
    # Ray kills workers when the *node* passes 95% memory; on a shared test machine that is
    # other people's memory, so its monitor is off here (the kernel's OOM killer still guards).
    saved = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    started = start_ray(RaySettings(workers=2, object_store_bytes=200 * 2**20))
    yield
    if started:
        ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)
    else:
        os.environ["RAY_memory_monitor_refresh_ms"] = saved


@pytest.fixture
def tiny4(make_tiny):
    return make_tiny("llama", initializer_range=0.2, num_hidden_layers=4)


def windows_of(n: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (n, t), generator=torch.Generator().manual_seed(seed))  # (N, T)


def spec_of(**fields) -> TableSpec:
    return TableSpec.from_dict(dict(n_samples=4, seq_len=32, rate_grid=GRID, batch_size=2) | fields)


def test_layer_ranges_are_contiguous_and_balanced():
    costs = {0: 10.0, 1: 9.0, 2: 8.0, 3: 7.0}
    assert layer_ranges(costs, 2) == [[0, 1], [2, 3]]
    assert layer_ranges(costs, 1) == [[0, 1, 2, 3]]
    assert layer_ranges({5: 1.0}, 4) == [[5]]
    runs = layer_ranges({i: 30.0 - i for i in range(30)}, 3)
    assert len(runs) == 3 and sum(runs, []) == list(range(30))
    assert len(runs[0]) < len(runs[-1])  # early layers cost more, so their run is shorter


@pytest.mark.slow
def test_two_ray_workers_give_the_single_process_table(local_ray, tiny4):
    windows = windows_of(4, 32)
    spec = spec_of(objective="kl")  # kl: the workers also get the dense final states
    single = measure_table(tiny4, spec, windows)
    cells = RayCells(RaySettings(workers=2))
    spread = measure_table(tiny4, spec, windows, cells=cells)
    np.testing.assert_array_equal(spread.cell_objective, single.cell_objective)
    assert spread.dense_objective == single.dense_objective
    assert spread.extras["distinct_cells"] == single.extras["distinct_cells"]
    assert len(cells.worker_pids) == 2 and cells.result_pids == set(cells.worker_pids)
    assert os.getpid() not in cells.result_pids


@pytest.mark.heavy
def test_a_killed_worker_is_restarted_and_the_table_completes_identically(local_ray, tiny4):
    windows = windows_of(4, 32, seed=1)
    spec = spec_of()
    single = measure_table(tiny4, spec, windows)
    killed = []

    def kill_second(pids):
        os.kill(pids[1], signal.SIGKILL)
        killed.append(pids[1])

    cells = RayCells(RaySettings(workers=2, max_restarts=2), on_submitted=kill_second)
    spread = measure_table(tiny4, spec, windows, cells=cells)
    np.testing.assert_array_equal(spread.cell_objective, single.cell_objective)
    assert killed and killed[0] not in cells.result_pids
    assert len(cells.result_pids - set(cells.worker_pids)) == 1  # the restarted process measured its cells again


@pytest.mark.heavy
def test_a_cancelled_ray_build_resumes_from_the_cache_through_a_lost_worker(local_ray, tiny4, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    spec = TableSpec(windows=WindowSpec(n_samples=4, seq_len=32, batch_size=2), rate_grid=(0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75))
    reference = loss_table(tiny4, spec, use_cache=False)
    event = threading.Event()

    def progress(done, total, eta):
        if done >= 5:
            event.set()

    with pytest.raises(CancelledError):
        loss_table(tiny4, spec, hooks=Hooks(progress=progress, cancel=event), cells=RayCells(RaySettings(workers=2)))
    saved = cache.PartialCells(reference.key).load()
    assert 5 <= len(saved) < reference.extras["distinct_cells"]
    # The resumed build also loses a worker: its layers are measured again by the restarted process.
    killed = []
    cells = RayCells(RaySettings(workers=2), on_submitted=lambda pids: killed.append(os.kill(pids[1], signal.SIGKILL) or pids[1]))
    resumed = loss_table(tiny4, spec, cells=cells)
    assert killed and killed[0] not in cells.result_pids
    assert resumed.extras["cells_resumed"] == len(saved)
    assert resumed.extras["cells_measured"] == reference.extras["distinct_cells"] - len(saved)
    np.testing.assert_array_equal(resumed.cell_objective, reference.cell_objective)
    assert cache.get_table(reference.key) is not None  # stored with its checksum (cache.get_table verifies it)
    assert not cache.PartialCells(reference.key).path.exists()


@pytest.mark.heavy
def test_when_restarts_run_out_a_live_worker_takes_the_layers(local_ray, tiny4):
    # Last in the module: it needs workers with other options, so the pool is replaced.
    windows = windows_of(4, 32, seed=2)
    spec = spec_of()
    single = measure_table(tiny4, spec, windows)
    cells = RayCells(RaySettings(workers=2, max_restarts=0), on_submitted=lambda pids: os.kill(pids[1], signal.SIGKILL))
    spread = measure_table(tiny4, spec, windows, cells=cells)
    np.testing.assert_array_equal(spread.cell_objective, single.cell_objective)
    assert cells.result_pids == {cells.worker_pids[0]}
