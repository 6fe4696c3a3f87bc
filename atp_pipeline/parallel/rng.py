"""Per-rank random streams for dropout on ATP's (dp, d1, d2) mesh.

After Megatron-Core's model-parallel RNG tracker (``megatron/core/tensor_parallel/random.py``:
``CudaRNGStatesTracker`` keeps named generator states and ``fork(name)`` swaps one into the
default generator for a region of code, saving its advance on the way out;
``model_parallel_cuda_manual_seed`` seeds the default stream alike on the tensor-parallel
ranks and the ``model-parallel-rng`` stream per rank). Megatron's 1-D layout needs two
streams; ATP's 2-D layout (§3.2) needs one per layout a tensor can have between and inside
the styled modules, each identical on the ranks that hold the same block of the tensor and
independent across ranks holding different blocks:

==================  =========================================  =========================
region              tensors drawn on                           stream depends on
==================  =========================================  =========================
``REPLICATED``      whole on every rank (inside ``gathered``   seed, dp
                    modules; after a ``full`` output)
``SPLIT_D2``        ATP's activations: hidden split over d2,   seed, dp, d2
                    replicated over d1 (between blocks)
``SPLIT_D1``        split over d1, replicated over d2 (after   seed, dp, d1
                    a column-first ``output=split``: the MLP's
                    hidden; heads before the core)
``LOCAL``           this rank's own heads (the attention core)  seed, dp, d1, d2
==================  =========================================  =========================

Data-parallel replicas draw independent masks (their samples are different rows of one
batch, as on one process; Megatron's default shares the seed across them).

:func:`install` (called by :func:`~atp_pipeline.parallel.apply.apply_plan`) puts the
generators under a :class:`RNGTracker` for the duration of the forward of the module that
encloses every styled module (forward hooks): the caller's generator states are saved on the
way in and restored on the way out, so code outside the model draws exactly what it would
without it. Inside, the *layout* region follows the styled modules: each styled module's
output layout selects the stream for the code after it, until the next styled module (whose
own code, e.g. an attention module's residual dropout, runs in ``SPLIT_D2``). Styles whose
inside has another layout fork for its duration (:func:`region`): ``gathered`` modules
``REPLICATED``, attention cores ``LOCAL``. Draws on one rank are then a function of the seed,
its coordinates and the order of the code, which is the same on every rank, with chunks
(§4.1) too: chunks switch only at collectives, which run inside styled modules and never
inside a fork. Backward passes draw nothing; evaluation (``training=False``) draws nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from atp_pipeline.parallel.materialize import shared_seed
from atp_pipeline.parallel.mesh import device_of, shard_seed

REPLICATED, SPLIT_D2, SPLIT_D1, LOCAL = "replicated", "split_d2", "split_d1", "local"
# the mesh axes each region's stream is independent across (the axes its tensors are split over)
REGION_AXES: Dict[str, Tuple[str, ...]] = {REPLICATED: (), SPLIT_D2: ("d2",), SPLIT_D1: ("d1",),
                                           LOCAL: ("d1", "d2")}

State = Tuple[torch.Tensor, Optional[torch.Tensor]]  # the CPU generator's state, the CUDA one's (or None)


class RNGTracker:
    """Named generator states swapped in and out of the default generators (the CPU one, and
    the current CUDA device's when ``cuda``), as Megatron's ``CudaRNGStatesTracker``.

    A stack of regions is active while the tracker is entered: the generators hold the live
    state of the top region, the others are kept in :attr:`states`; below the stack, the
    caller's states wait to be restored."""

    def __init__(self, seeds: Mapping[str, int], cuda: bool = False) -> None:
        self.cuda = cuda
        self.seeds = dict(seeds)
        self.states: Dict[str, State] = {name: self._seeded(s) for name, s in self.seeds.items()}
        self.stack: List[str] = []
        self._caller: Optional[State] = None

    def _seeded(self, seed: int) -> State:
        cpu = torch.Generator().manual_seed(seed).get_state()
        gpu = torch.Generator(device=torch.device("cuda", torch.cuda.current_device())).manual_seed(seed).get_state() \
            if self.cuda else None
        return cpu, gpu

    def _get(self) -> State:
        return torch.get_rng_state(), torch.cuda.get_rng_state() if self.cuda else None

    def _set(self, state: State) -> None:
        torch.set_rng_state(state[0])
        if self.cuda and state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    @property
    def active(self) -> bool:
        return bool(self.stack)

    def enter(self, name: str) -> None:
        """Draw from ``name``'s stream until the matching :meth:`leave`."""
        if self.stack:
            self.states[self.stack[-1]] = self._get()
        else:
            self._caller = self._get()
        self._set(self.states[name])
        self.stack.append(name)

    def leave(self) -> None:
        """Save the top region's advance and go back to the region (or caller) below it."""
        self.states[self.stack.pop()] = self._get()
        self._set(self.states[self.stack[-1]] if self.stack else self._caller)  # type: ignore[arg-type]
        if not self.stack:
            self._caller = None

    def switch(self, name: str) -> None:
        """Make ``name`` the bottom (layout) region of an active tracker; nothing when inactive."""
        if not self.stack or self.stack[0] == name:
            return
        if len(self.stack) == 1:
            self.states[self.stack[0]] = self._get()
            self._set(self.states[name])
        self.stack[0] = name

    @contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Megatron's ``fork``: the code in the ``with`` block draws from ``name``'s stream."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave()


def tracker_for(mesh: DeviceMesh, seed: Optional[int] = None) -> RNGTracker:
    """The :class:`RNGTracker` of this rank of ``mesh``: one stream per region, seeded from
    ``seed`` and the coordinates the region's tensors are split over (plus dp). By default
    ``seed`` is global rank 0's ``torch.initial_seed()`` (what ``torch.manual_seed`` or
    Lightning's ``seed_everything`` set), broadcast at layout time: ranks seeded differently,
    or not at all, still share the streams they must share."""
    base = shared_seed(device_of(mesh)) if seed is None else int(seed)
    names = tuple(mesh.mesh_dim_names or ())
    coord = dict(zip(names, mesh.get_coordinate() or ()))
    seeds = {name: shard_seed(base, f"dropout/{name}", tuple(int(coord.get(a, 0)) for a in ("dp", *axes)))
             for name, axes in REGION_AXES.items()}
    return RNGTracker(seeds, cuda=mesh.device_type == "cuda")


_ACTIVE: List[RNGTracker] = []  # the trackers of the laid-out forwards in progress (process-wide: chunks
# run in threads of their own, one at a time)


@contextmanager
def region(name: str) -> Iterator[None]:
    """Draw from ``name``'s stream of the laid-out forward in progress (nothing changes outside one)."""
    if not _ACTIVE:
        yield
        return
    with _ACTIVE[-1].fork(name):
        yield


def fork_module(module: nn.Module, name: str) -> None:
    """Run ``module``'s own ``forward`` in ``name``'s region of the laid-out forward in progress:
    after its pre-hooks and before its hooks, so collectives there stay outside the fork."""
    entered: List[bool] = []  # per call: whether a tracker was entered (no chunk switch comes between)

    def enter(mod: nn.Module, args: tuple) -> None:
        entered.append(bool(_ACTIVE))
        if _ACTIVE:
            _ACTIVE[-1].enter(name)

    def leave(mod: nn.Module, args: tuple, out: object) -> None:
        if entered and entered.pop() and _ACTIVE:
            _ACTIVE[-1].leave()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, prepend=True, always_call=True)


def _enclosing(root: nn.Module, names: List[str]) -> nn.Module:
    """The innermost module of ``root`` whose ``forward`` calls every module in ``names``:
    their parents' common ancestor, above any container whose ``forward`` never runs."""
    parents = [n.split(".")[:-1] for n in names]
    common: List[str] = []
    for parts in zip(*parents):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    while common and isinstance(root.get_submodule(".".join(common)), (nn.ModuleList, nn.ModuleDict)):
        common.pop()
    return root.get_submodule(".".join(common)) if common else root


def install(root: nn.Module, after: Mapping[str, str], mesh: DeviceMesh, seed: Optional[int] = None) -> RNGTracker:
    """Put the forward of ``root``'s laid-out modules under this rank's :class:`RNGTracker`.

    ``after``: ``{styled module name: the region of the code after it}`` (its output's
    layout). The module enclosing all of them enters ``REPLICATED`` (its inputs are whole) and
    restores the caller's generators when it returns, also on an exception; each styled module
    sets the layout region to ``SPLIT_D2`` for its own code and to its ``after`` region
    for the code that follows."""
    tracker = tracker_for(mesh, seed)
    for name, next_region in after.items():
        module = root.get_submodule(name)
        module.register_forward_pre_hook(lambda m, a: tracker.switch(SPLIT_D2), prepend=True)
        module.register_forward_hook(lambda m, a, o, r=next_region: tracker.switch(r))
    if not after:
        return tracker

    depths: List[int] = []  # the tracker's depth at each call in progress (a forward may nest)

    def begin(module: nn.Module, args: tuple) -> None:
        depths.append(len(tracker.stack))
        _ACTIVE.append(tracker)
        tracker.enter(REPLICATED)

    def end(module: nn.Module, args: tuple, out: object) -> None:
        if depths:
            depth = depths.pop()
            while len(tracker.stack) > depth:
                tracker.leave()
            _ACTIVE.remove(tracker)

    outer = _enclosing(root, list(after))
    outer.register_forward_pre_hook(begin, prepend=True)
    outer.register_forward_hook(end, always_call=True)
    return tracker
