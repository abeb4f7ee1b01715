"""`make test` runs the suite in pytest-xdist workers that split the cores between them
(``conftest.share_cores_between_workers``)."""

from __future__ import annotations

import os

import torch
from conftest import share_cores_between_workers, usable_cores


def test_each_worker_and_its_subprocesses_get_their_share_of_the_cores(monkeypatch):
    cores = usable_cores()
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        monkeypatch.setenv("OMP_NUM_THREADS", "99")
        share_cores_between_workers()
        assert torch.get_num_threads() == max(1, cores // 2)
        assert os.environ["OMP_NUM_THREADS"] == str(max(1, cores // 2))  # what a CLI or app subprocess reads
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(4 * cores))
        share_cores_between_workers()
        assert torch.get_num_threads() == 1  # never zero threads
    finally:
        torch.set_num_threads(before)


def test_one_process_keeps_every_core(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    share_cores_between_workers()
    assert torch.get_num_threads() == before and os.environ["OMP_NUM_THREADS"] == "7"
