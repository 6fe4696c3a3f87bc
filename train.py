"""The Hydra app: ``python train.py [overrides]`` (see README.md).

Registers the config schemas and the ``mesh=<d1>x<d2>`` config source, composes ``conf/``
into the typed config, checks every group's values (:func:`~atp_pipeline.config.schema.typed`)
and runs it (:func:`atp_pipeline.run.run`). Bad input exits with one line and status 2, before
any process is started.
"""

import hydra
from omegaconf import DictConfig

from atp_pipeline.cli import exits_on_bad_input, guarded
from atp_pipeline.config import register_mesh_source, register_schemas
from atp_pipeline.config.schema import typed
from atp_pipeline.run import run

register_schemas()
register_mesh_source()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
@exits_on_bad_input
def app(cfg: DictConfig) -> None:
    typed(cfg)  # each group's own checks (a count <= 0, ...): one line, before run() starts anything
    run(cfg)


if __name__ == "__main__":
    guarded(app)
