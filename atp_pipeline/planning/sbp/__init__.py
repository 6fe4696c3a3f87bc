"""AutoDDL SBP strategy search: alpha-beta collectives, the SBP matmul space, search;
any model's layer chain from its shape."""

from atp_pipeline.planning.alphabeta import AlphaBeta, Collective, LinkLevel, volume
from atp_pipeline.planning.sbp.chain import chain_keys, model_chain, sbp_infeasibility
from atp_pipeline.planning.sbp.search import METHODS, SearchResult, search, search_all
from atp_pipeline.planning.sbp.space import (
                                             MatmulLayer,
                                             MemoryModel,
                                             Problem,
                                             Strategy,
                                             compile_problem,
                                             direct,
                                             mlp,
                                             strategies,
                                             transformer,
)

__all__ = ["AlphaBeta", "Collective", "LinkLevel", "volume", "METHODS", "SearchResult", "search",
           "search_all", "MatmulLayer", "MemoryModel", "Problem", "Strategy", "compile_problem",
           "direct", "mlp", "strategies", "transformer", "chain_keys", "model_chain", "sbp_infeasibility"]
