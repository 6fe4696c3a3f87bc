"""The Hydra app: ``python train.py [overrides]`` (see README.md).

Composes ``conf/`` into the typed config and runs the pipeline
(:mod:`atp_pipeline.pipeline`). Bad input exits with one line and status 2.
"""

import hydra
from omegaconf import DictConfig

import atp_pipeline  # noqa: F401  (registers schemas and the mesh config source)
from atp_pipeline.cli import exits_on_bad_input, guarded
from atp_pipeline.pipeline import run


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
@exits_on_bad_input
def app(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    guarded(app)
