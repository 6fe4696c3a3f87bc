"""The P4 toolchain for the tests: found on PATH or in /opt/p4tools/bin (``$ATP_P4TOOLS``);
tests that need it skip with the reason where it is missing. The v1model program is compiled
once per session."""

from pathlib import Path
from typing import Tuple

import pytest

from atp_pipeline.ina.p4 import toolchain as tc

from . import V1MODEL_P4


@pytest.fixture(scope="session")
def v1model_build(tmp_path_factory) -> Tuple[tc.CompileResult, Path]:
    """``p4c-bm2-ss`` on ``p4/v1model/atp.p4`` (the generated ``ATP_N_AGG``): the result and
    the BMv2 JSON."""
    why = tc.why_missing(["p4c-bm2-ss"])
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("p4c") / "atp.json"
    return tc.compile_v1model(V1MODEL_P4, out), out


@pytest.fixture(scope="session")
def v1model_json(v1model_build) -> Path:
    res, out = v1model_build
    res.check()
    return out
