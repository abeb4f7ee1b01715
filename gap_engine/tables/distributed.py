"""Exact table cells spread over Ray workers: ``gap table ... --ray [ADDRESS]``.

A loss table is embarrassingly parallel: a cell of layer ``i`` needs only the hidden states
entering block ``i`` (from one dense pass) and the blocks ``i..L-1`` with the LM head. So
the driver makes the dense pass itself, then each worker (a Ray actor, one per process)

- owns a contiguous range of layers, the ranges balanced by what their cells cost;
- receives the block inputs of its layers (one Ray object per layer), the block calls and
  the token ids (shared objects);
- loads only the blocks it needs (``i..L-1`` for its earliest layer ``i``), from objects
  the driver put once, latest layers first, so late-layer workers never hold early blocks;
- measures its cells with the resident builder's own function (``cells.run_cell``) or, when
  the placement streams, ``tables.streaming.streamed_cells``, and returns them per layer.

The driver records every returned cell in the same ledger and partial file as a
single-process build (``CellLedger``, ``cache.PartialCells``), so a killed driver resumes
from what it saved, and a lost worker's cells are simply measured again: Ray restarts the
actor and retries its calls, and when restarts run out the driver gives the dead worker's
layers to a live one. Cells are the same arithmetic on the same inputs as in one process,
so the table is the same (``tests/tables/test_distributed.py``). Without ``--ray`` nothing here
runs and ray is never imported.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch
from torch import nn

from gap_engine.core.device import DeviceSpec, dtype_name, placement_of
from gap_engine.core.errors import CancelledError, GapError, InvariantError, one_line
from gap_engine.core.validate import check_int
from gap_engine.model.adapters import ArchitectureAdapter
from gap_engine.model.layerwise import BlockCall, tree_to
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.cells import Cut, DenseState
from gap_engine.tables.exact import exact_cells
from gap_engine.tables.ledger import BuildStats, CellLedger, CellObjectives, CellRequest, Job, block_costs

if TYPE_CHECKING:
    from gap_engine.model.loaded import LoadedModel

log = logging.getLogger(__name__)

# Ray is an optional dependency imported on first use, so the module travels as a ModuleType
# (its attributes are Any to mypy); actor handles and object references get their
# `.remote` methods at run time, so they are Any as well.
Actor = Any  # a CellWorker actor handle
ObjectRef = Any  # a ray.ObjectRef


class SharedRefs(TypedDict):
    """What every call of one build shares, put in Ray's object store once."""

    build: str  # which build (a worker set up for another one sets itself up again)
    shell: ObjectRef  # (the model without its blocks, the decoder attribute that holds them)
    blocks: list[ObjectRef | None]  # [j] host copy of block j; None before the earliest layer with work
    calls: ObjectRef  # [b][j] BlockCall
    batches: ObjectRef  # [b] (B, T) token ids
    final: ObjectRef | None  # [b] (B, T, d) final hidden states (kl objective only)
    layer_inputs: dict[int, ObjectRef]  # layer -> [b] (B, T, d) its dense inputs, put when first needed
    objective: str
    positions: int  # counted positions the objective is divided by
    start: int  # leading non-text positions (BOS), never counted


class UnitRefs(TypedDict):
    """What one call of ``CellWorker.measure`` is given: the shared references and one layer's inputs."""

    build: str
    shell: ObjectRef
    blocks: list[ObjectRef | None]
    calls: ObjectRef
    batches: ObjectRef
    final: ObjectRef | None
    objective: str
    positions: int
    start: int
    inputs: ObjectRef  # [b] (B, T, d) inputs of the layer measured


class RayError(GapError):
    """Ray is missing, unreachable, or lost every worker."""


@dataclass(frozen=True)
class RaySettings:
    """Where and how wide a Ray build runs."""

    address: str | None = None  # None: start a local instance; else a cluster ("auto", "host:6379", "ray://host:10001")
    workers: int = 2  # worker processes (actors), one per GPU on accelerators
    cpus_per_worker: int = 1  # torch threads and Ray CPUs of each worker
    max_restarts: int = 2  # a killed worker process is restarted this often (its calls retried)
    object_store_bytes: int | None = None  # local instance only: shared-memory object store size (None: Ray's default)

    def validate(self) -> RaySettings:
        for name in ("workers", "cpus_per_worker"):
            check_int(getattr(self, name), f"ray {name}", RayError, low=1)
        return self


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise RayError("--ray needs the 'ray' package: pip install 'gap-engine[ray]'") from None
    return ray


def start_ray(settings: RaySettings) -> bool:
    """Connect to ``settings.address`` or start a local instance; True when this call started it.

    A local instance has exactly the CPUs its workers need, no dashboard, and puts this
    checkout on the workers' PYTHONPATH (a cluster needs gap_engine installed on its nodes).
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    try:
        if settings.address:
            ray.init(address=settings.address, log_to_driver=False)
        else:
            root = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
            ray.init(
                num_cpus=settings.workers * settings.cpus_per_worker,
                num_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=settings.object_store_bytes,
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            )
    except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError ...
        where = settings.address or "a local instance"
        raise RayError(f"cannot start Ray at {where}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}") from None
    return True


# ---- who owns which layers ---------------------------------------------------------------------
def layer_ranges(costs: dict[int, float], workers: int) -> list[list[int]]:
    """Contiguous runs of layers (ascending) with about equal summed cost, at most ``workers`` runs.

    Args:
        costs: layer -> cost of its cells still to measure (layers without work are absent).
        workers: how many runs at most.
    """
    layers = sorted(costs)
    total = sum(costs.values())
    runs: list[list[int]] = [[]]
    spent = 0.0
    for layer in layers:
        # Start the next run once this one holds its share, keeping a run for every worker left.
        if runs[-1] and spent >= total * len(runs) / workers and len(runs) < workers:
            runs.append([])
        runs[-1].append(layer)
        spent += costs[layer]
    return [run for run in runs if run]


# ---- the worker --------------------------------------------------------------------------------
def shell_of(model: nn.Module, adapter: ArchitectureAdapter) -> tuple[nn.Module, str]:
    """A host copy of the model without its blocks (embeddings, final norm, LM head, config),
    and the name of the decoder attribute that holds the blocks."""
    decoder, layers = adapter.decoder(model), adapter.layers(model)
    name = next(child_name for child_name, child in decoder.named_children() if child is layers)
    setattr(decoder, name, nn.ModuleList())
    try:
        return copy.deepcopy(model).cpu(), name
    finally:
        setattr(decoder, name, layers)


def host_block(layer: nn.Module) -> nn.Module:
    """The block itself when it lives on the host, else a host copy (what goes into the object store)."""
    return layer if next(layer.parameters()).device.type == "cpu" else copy.deepcopy(layer).cpu()


class CellWorker:
    """One Ray actor: a model of placeholder blocks that loads real ones as its layers need them.

    Everything a build needs comes with each call (as object references), so a worker that
    Ray restarts after a crash, or one kept for the next build, sets itself up again from them.
    """

    def __init__(self, device: DeviceSpec, threads: int):
        from gap_engine.core.device import resolve

        torch.set_num_threads(threads)
        self.placement = resolve(device)
        self.build: str | None = None  # which build the model below belongs to
        self.lm: LoadedModel | None = None  # set up from the first call of a build
        self.loaded: set[int] = set()
        self.shared: dict[str, object] = {}

    def pid(self) -> int:
        return os.getpid()

    def _setup(self, refs: UnitRefs) -> None:
        import ray

        from gap_engine.model.adapters import adapter_for
        from gap_engine.model.loaded import LoadedModel

        model, layers_name = ray.get(refs["shell"])
        model = model.to(self.placement.device)
        adapter = adapter_for(model)
        placeholders = nn.ModuleList([nn.Identity() for _ in refs["blocks"]])  # run only once loaded
        setattr(adapter.decoder(model), layers_name, placeholders)
        self.lm = LoadedModel(
            name="ray-worker", model=model, tokenizer=None, adapter=adapter, fingerprint="", source="ray", placement=self.placement
        )
        self.build, self.loaded, self.shared = refs["build"], set(), {}

    def _get(self, ref: ObjectRef) -> Any:
        import ray

        key = ref.hex()
        if key not in self.shared:
            self.shared[key] = tree_to(ray.get(ref), self.placement.device)
        return self.shared[key]

    def _load_blocks(self, block_refs: list[ObjectRef | None], first: int) -> None:
        import ray

        if self.lm is None:
            raise InvariantError("the worker has no model (_setup runs first)")
        layers = self.lm.adapter.layers(self.lm.model)
        for j in range(first, len(layers)):
            if j not in self.loaded:
                ref = block_refs[j]
                if ref is None:
                    raise InvariantError("no block was shipped for a layer with work (blocks from the first such layer are)")
                block = cast(nn.Module, ray.get(ref))
                layers[j] = block if self.placement.stream else block.to(self.placement.device)
                self.loaded.add(j)

    def measure(self, layer: int, jobs: list[tuple[int, Cut]], refs: UnitRefs) -> tuple[int, list[tuple[int, float]]]:
        """Cells of one layer: [(job index, objective per position)], with this process's id."""
        import ray

        from gap_engine.tables.cells import run_cell
        from gap_engine.tables.streaming import streamed_cells

        if self.build != refs["build"]:
            self._setup(refs)
        self._load_blocks(refs["blocks"], layer)
        calls: list[list[BlockCall]] = self._get(refs["calls"])
        batches: list[torch.Tensor] = self._get(refs["batches"])
        final = self._get(refs["final"]) if refs["final"] is not None else [None] * len(batches)
        inputs = tree_to(ray.get(refs["inputs"]), self.placement.device)  # [b] (B, T, d)
        if self.lm is None:
            raise InvariantError("the worker has no model (_setup runs first)")
        n_layers = len(self.lm.adapter.layers(self.lm.model))
        block_inputs = [[inputs[b] if i == layer else None for i in range(n_layers)] for b in range(len(batches))]
        # A worker's state holds only the inputs of the block it measures (and, without a
        # last block, no final states): the None entries are never read.
        state = DenseState(batches, block_inputs, calls, final, None, [], refs["start"])  # type: ignore[arg-type]
        objective, positions = refs["objective"], refs["positions"]
        if self.placement.stream:
            sums = streamed_cells(self.lm, state, [cut for _, cut in jobs], (objective,))
            values = [float(s[objective].sum()) / positions for s in sums]
        else:
            values = [run_cell(self.lm, state, cut, objective) / positions for _, cut in jobs]
        return os.getpid(), [(k, value) for (k, _), value in zip(jobs, values)]


# ---- the driver --------------------------------------------------------------------------------
# Workers outlive one build (starting a process that imports torch takes seconds): the app
# and the tests build several tables in one process. Keyed by the actor options.
WORKERS: dict[str, list[Actor]] = {}


def worker_pool(ray: ModuleType, count: int, options: dict[str, int], args: tuple[DeviceSpec, int]) -> list[Actor]:
    """``count`` live CellWorker actors with these options, reusing the ones from earlier builds."""
    key = repr((sorted(options.items()), args))
    for other in [k for k in WORKERS if k != key]:  # one pool at a time: idle actors still hold their CPUs/GPUs
        for actor in WORKERS.pop(other):
            ray.kill(actor)
    pool: list[Actor] = []
    for actor in WORKERS.get(key, []):
        try:
            ray.get(actor.pid.remote(), timeout=60)
            pool.append(actor)
        except Exception:  # dead, or too busy to answer: killed, since a live one keeps its CPUs/GPUs, and replaced below
            ray.kill(actor)
            continue
    worker_class = ray.remote(CellWorker)
    while len(pool) < count:
        pool.append(worker_class.options(**options).remote(*args))
    WORKERS[key] = pool
    return pool[:count]


@dataclass
class RayCells:
    """Exact cells measured by Ray workers; called like ``exact.measure_exact``, and sharing its
    cuts, dense pass and ledger (``exact.exact_cells``): only the schedule differs.

    Attributes set during a build (for tests and reports): ``worker_pids`` (the first process
    of every worker), ``result_pids`` (every process that returned cells).
    """

    settings: RaySettings = field(default_factory=RaySettings)
    on_submitted: Callable[[list[int]], None] | None = None  # told the workers' pids once all work is queued
    worker_pids: list[int] = field(default_factory=list)
    result_pids: set[int] = field(default_factory=set)

    def __call__(self, request: CellRequest) -> CellObjectives:
        """The cell filler (``ledger.CellFiller``) whose cells Ray workers measure."""
        self.settings.validate()

        def schedule(state: DenseState, ledger: CellLedger, positions: int) -> BuildStats:
            started = time.perf_counter()
            try:
                if ledger.missing():
                    self._run(request.lm, request.spec, state, ledger, positions)
            finally:
                ledger.flush()
            return {
                "ray_workers": self.settings.workers,
                "ray_worker_processes": len(self.result_pids),
                "ray_seconds": round(time.perf_counter() - started, 3),
            }

        return exact_cells(request, schedule)

    def _run(self, lm: LoadedModel, spec: TableSpec, state: DenseState, ledger: CellLedger, positions: int) -> None:
        ray = import_ray()
        started_here = start_ray(self.settings)
        actors: list[Actor] = []
        try:
            by_layer = self._units(ledger)
            refs = self._put_shared(ray, lm, spec, state, positions, min(by_layer))
            placement = placement_of(lm)
            device = DeviceSpec(
                "cuda" if placement.device.type == "cuda" else str(placement.device.type), dtype_name(placement.dtype), placement.stream
            )
            options = dict(
                num_cpus=self.settings.cpus_per_worker,
                num_gpus=1 if placement.device.type == "cuda" else 0,
                max_restarts=self.settings.max_restarts,
                max_task_retries=self.settings.max_restarts,
            )
            blocks, head = block_costs(lm)
            costs = {layer: sum(blocks - layer + head for _ in ks) for layer, ks in by_layer.items()}
            ranges = layer_ranges(costs, self.settings.workers)
            actors = worker_pool(ray, len(ranges), options, (device, self.settings.cpus_per_worker))
            self.worker_pids = ray.get([a.pid.remote() for a in actors])
            pending: dict[ObjectRef, tuple[int, int]] = {}  # call -> (worker, layer)
            for w, run in enumerate(ranges):
                for layer in sorted(run, reverse=True):  # latest first: each block is loaded when first needed
                    pending[self._submit(actors[w], layer, by_layer[layer], ledger.jobs, refs, state)] = (w, layer)
            if self.on_submitted:
                self.on_submitted(list(self.worker_pids))
            self._collect(ray, actors, pending, by_layer, refs, state, ledger)
        finally:
            if started_here:
                WORKERS.clear()
                ray.shutdown()

    @staticmethod
    def _units(ledger: CellLedger) -> dict[int, list[int]]:
        by_layer: dict[int, list[int]] = {}
        for k in ledger.missing():
            by_layer.setdefault(ledger.jobs[k][2].layer, []).append(k)
        return by_layer

    @staticmethod
    def _put_shared(ray: ModuleType, lm: LoadedModel, spec: TableSpec, state: DenseState, positions: int, first_layer: int) -> SharedRefs:
        host = torch.device("cpu")
        layers = lm.adapter.layers(lm.model)
        return {
            "build": f"{os.getpid()}-{time.time_ns()}",
            "shell": ray.put(shell_of(lm.model, lm.adapter)),
            # Blocks before the earliest layer with work are needed by no cell: never shipped.
            "blocks": [ray.put(host_block(layer)) if j >= first_layer else None for j, layer in enumerate(layers)],
            "calls": ray.put(tree_to(state.block_calls, host)),
            "batches": ray.put(tree_to(state.batches, host)),
            "final": ray.put(tree_to(state.final_hidden, host)) if spec.objective == "kl" else None,
            "layer_inputs": {},
            "objective": spec.objective,
            "positions": positions,
            "start": state.start,  # leading non-text positions (BOS), never counted
        }

    @staticmethod
    def _submit(actor: Actor, layer: int, ks: list[int], jobs: list[Job], refs: SharedRefs, state: DenseState) -> ObjectRef:
        import ray

        if layer not in refs["layer_inputs"]:
            refs["layer_inputs"][layer] = ray.put([inputs[layer].cpu() for inputs in state.block_inputs])
        unit_refs = UnitRefs(
            build=refs["build"],
            shell=refs["shell"],
            blocks=refs["blocks"],
            calls=refs["calls"],
            batches=refs["batches"],
            final=refs["final"],
            objective=refs["objective"],
            positions=refs["positions"],
            start=refs["start"],
            inputs=refs["layer_inputs"][layer],
        )
        return actor.measure.remote(layer, [(k, jobs[k][2]) for k in ks], unit_refs)

    def _collect(
        self,
        ray: ModuleType,
        actors: list[Actor],
        pending: dict[ObjectRef, tuple[int, int]],
        by_layer: dict[int, list[int]],
        refs: SharedRefs,
        state: DenseState,
        ledger: CellLedger,
    ) -> None:
        """Record results as they come; give a dead worker's layers to a live one."""
        alive = set(range(len(actors)))
        while pending:
            if ledger.hooks.is_cancelled():
                for ref in pending:  # queued layers would hold up the workers' next build; a running one finishes
                    ray.cancel(ref)
                raise CancelledError(f"loss table build cancelled after {ledger.done_message()}")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in ready:
                w, layer = pending.pop(ref)
                try:
                    pid, values = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:  # the worker raised: a real error, not a lost process
                    raise RayError(f"a Ray worker failed on layer {layer}: {one_line(exc.cause or exc)}") from None
                except ray.exceptions.RayError as exc:  # the process was lost (killed, out of memory, node gone)
                    alive.discard(w)
                    if not alive:
                        raise RayError(
                            f"every Ray worker was lost ({type(exc).__name__}); measured cells are saved, run again to resume"
                        ) from None
                    heir = min(alive, key=lambda a: sum(1 for owner, _ in pending.values() if owner == a))
                    log.warning("Ray worker %d was lost; layer %d goes to worker %d", w, layer, heir)
                    pending[self._submit(actors[heir], layer, by_layer[layer], ledger.jobs, refs, state)] = (heir, layer)
                    continue
                self.result_pids.add(pid)
                for k, value in values:
                    ledger.record(k, value)
