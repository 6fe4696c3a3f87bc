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
