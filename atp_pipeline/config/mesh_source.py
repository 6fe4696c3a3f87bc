"""A Hydra ConfigSource that answers ``mesh=<d1>x<d2>`` for any sizes.

A fixed mesh is data, not a file: rather than shipping one YAML per factorization, this
source synthesizes ``mesh/<d1>x<d2>`` as ``{strategy: fixed, d1, d2}`` (validated by the
:class:`~atp_pipeline.config.schema.MeshConfig` schema like any other option). Whether the
mesh fits the topology is checked by the planner, which names both sizes in its error.
It is registered with Hydra's public ``Plugins.register`` when :mod:`atp_pipeline` is
imported, and ``conf/config.yaml`` puts ``atpmesh://`` on the search path.
"""

from __future__ import annotations

import re
from typing import List, Optional

from hydra.core.object_type import ObjectType
from hydra.core.plugins import Plugins
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from omegaconf import OmegaConf

SCHEME = "atpmesh"
_GROUP = "mesh"
_NAME = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)$")
# What `--cfg`/completion/"available options" list: every 2D mesh of 1..64 devices whose
# sizes are powers of two. Any other <d1>x<d2> is still accepted.
_LISTED = [f"{a}x{n // a}" for n in (1, 2, 4, 8, 16, 32, 64) for a in range(1, n + 1) if n % a == 0]


def parse_mesh_name(name: str) -> Optional[tuple[int, int]]:
    """``"2x4"`` -> ``(2, 4)``; anything else -> None."""
    match = _NAME.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


class MeshConfigSource(ConfigSource):
    @staticmethod
    def scheme() -> str:
        return SCHEME

    def _name(self, config_path: str) -> Optional[str]:
        path = self._normalize_file_name(config_path.strip("/"))
        if not path.endswith(".yaml"):
            return None
        group, _, name = path[: -len(".yaml")].rpartition("/")
        return name if group == _GROUP and parse_mesh_name(name) else None

    def load_config(self, config_path: str) -> ConfigResult:
        name = self._name(config_path)
        if name is None:
            raise ConfigLoadError(f"{SCHEME}: no config {config_path}")
        d1, d2 = parse_mesh_name(name)  # type: ignore[misc]
        node = OmegaConf.create({"strategy": "fixed", "d1": d1, "d2": d2})
        return ConfigResult(config=node, path=f"{SCHEME}://{self.path}", provider=self.provider,
                            header={"package": None})

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") == _GROUP

    def is_config(self, config_path: str) -> bool:
        return self._name(config_path) is not None

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        if config_path.strip("/") != _GROUP or results_filter == ObjectType.GROUP:
            return []
        return list(_LISTED)


def register_mesh_source() -> None:
    Plugins.instance().register(MeshConfigSource)
