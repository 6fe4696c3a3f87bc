"""The suite's scheduling under ``python -m pytest -n 2`` (pyproject: ``--dist loadgroup``):
each test module is one xdist group (tests/conftest.py), so its module-scoped launches (the
4- and 8-process exactness runs) run once, on one worker. pytest-xdist groups by a suffix it
appends to each node id; pytest 9.2 no longer takes that suffix (the node id became a
structured ``_id``), every module's tests were spread over both workers and each worker ran
the launches again (the suite took 30 instead of ~12 minutes). pyproject caps pytest below 9.2;
this fails in one line on a version where the groups are lost again."""

from __future__ import annotations

import pytest


def test_a_module_is_one_xdist_group_on_one_worker(request):
    if not hasattr(request.config, "workerinput"):
        pytest.skip("not under pytest-xdist (-n): nothing is distributed")
    if not request.config.getvalue("loadgroup"):
        pytest.skip("not --dist loadgroup")
    assert request.node.nodeid.endswith("@test_xdist_groups.py"), (
        f"pytest-xdist's group suffix is not in the node id ({request.node.nodeid}): loadgroup spreads a "
        f"module over the workers on this pytest/pytest-xdist")
