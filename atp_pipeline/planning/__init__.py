"""Cost models and searches: ATP's mesh planner (Eq. 2-4) and its report."""

from atp_pipeline.planning.bandwidth import DimBandwidth, LevelCrossing, dimension_bandwidth, rabenseifner
from atp_pipeline.planning.cost import (
    CommTerm,
    collective_seconds,
    eq2_terms,
    predicted_elements,
    runtime_terms,
    step_comm_time,
)
from atp_pipeline.planning.flops import ModelSummary
from atp_pipeline.planning.search import Candidate, Plan, candidate_meshes, evaluate, make_plan

__all__ = [
    "Candidate", "CommTerm", "DimBandwidth", "LevelCrossing", "ModelSummary", "Plan",
    "candidate_meshes", "collective_seconds", "dimension_bandwidth", "eq2_terms",
    "predicted_elements", "runtime_terms", "evaluate", "make_plan",
    "rabenseifner", "step_comm_time",
]
