"""The launcher's failure report: a rank that raises is reported with its traceback, and
ranks that stay blocked past the grace period are terminated after printing their stacks."""

import time

import pytest

from atp_pipeline.launch import spawn


def _one_fails_one_hangs(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("rank zero gives up")
    _blocked_forever()


def _blocked_forever() -> None:
    while True:
        time.sleep(0.1)


def test_a_hung_rank_is_terminated_with_its_stack_after_the_grace(capfd, monkeypatch):
    monkeypatch.setenv("ATP_START_METHOD", "spawn")  # children write to this test's captured stderr
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        spawn(_one_fails_one_hangs, 2, init=False, failure_grace=2.0, timeout=120)
    text = str(err.value)
    assert "rank 0 failed:" in text and "rank zero gives up" in text, text
    assert "ranks [1] gave no result within 2 s of the first failure; terminated" in text, text
    assert "_blocked_forever" in capfd.readouterr().err  # the hung rank's stack, from faulthandler
    assert time.monotonic() - t0 < 60


def _rank_sum(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return int(t.item())


def test_a_rendezvous_port_taken_before_rank_0_listens_is_retried_on_another(monkeypatch, capfd):
    """Another process may take the free port between its choice and rank 0's listen (a
    concurrent launch did, in CI): rank 0 fails with EADDRINUSE, the others would wait for
    it forever; the launch is repeated at once on a new port."""
    import socket

    import atp_pipeline.launch as launch

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    ports = [busy.getsockname()[1]]
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: ports.pop() if ports else real())
    t0 = time.monotonic()
    try:
        assert spawn(_rank_sum, 2, failure_grace=60.0, timeout=120) == [3, 3]
    finally:
        busy.close()
    assert "launching again on another port (1 of 2)" in capfd.readouterr().err
    assert time.monotonic() - t0 < 50  # not the 60 s grace: the others are not waited for
