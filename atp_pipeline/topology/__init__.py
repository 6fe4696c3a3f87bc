"""The hierarchical communication matrix: validation, sub-topologies, builders."""

from atp_pipeline.topology.model import Level, Topology

__all__ = ["Level", "Topology"]
