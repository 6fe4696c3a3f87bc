"""AutoDDL SBP strategy search (issue 8): alpha-beta collectives, the SBP matmul space, search."""

from atp_pipeline.planning.sbp.alphabeta import AlphaBeta, Collective, LinkLevel, volume
from atp_pipeline.planning.sbp.search import METHODS, SearchResult, search, search_all
from atp_pipeline.planning.sbp.space import (MatmulLayer, MemoryModel, Problem, Strategy,
                                             compile_problem, mlp, strategies, transformer)

__all__ = ["AlphaBeta", "Collective", "LinkLevel", "volume", "METHODS", "SearchResult", "search",
           "search_all", "MatmulLayer", "MemoryModel", "Problem", "Strategy", "compile_problem",
           "mlp", "strategies", "transformer"]
