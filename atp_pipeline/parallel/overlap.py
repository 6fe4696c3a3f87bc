"""Chunk-based overlap (ATP §4.1, Figure 8) for any module laid out by styles.

:func:`chunk_blocks` makes each repeated block of a model (each element of its outermost
``nn.ModuleList``s, the same units FSDP shards) run its forward on ``chunks`` pieces of
the micro-batch as a **wavefront**: every chunk runs the block's own ``forward`` (the
family's code, unchanged) in a coroutine of its own, and every collective of the runtime
it reaches (:class:`~atp_pipeline.parallel.comm.Comm`: a linear's all-reduce, the heads'
gather, a norm's statistics) is launched asynchronously at a *yield point*: the chunk
passes control to the next chunk, which computes up to its own collective, and waits for
its collective only when control comes back. So one chunk's collective is in flight while
another chunk computes, whatever the block's code is; with ``chunks = 1`` nothing changes.

Coroutines are threads of a small pool (made once: a new thread's first kernels pay the
libraries' per-thread set-up) of which exactly one runs at a time (a baton passed
round-robin), with the caller's grad mode, autocast (mixed precision) and intra-op thread
count (each is per thread: a new thread would otherwise compute in float32 under
``bf16-mixed``, or on every core while its process is meant to use its own). The order in
which collectives are issued is the same on every rank: the schedule is a function of the
code alone.

**The backward is a wavefront too** (:class:`_ChunkedBlock`): each chunk's inputs are
leaves of a graph of its own, so the block's backward runs each chunk's graph in its
coroutine and the chunks take turns at every collective of the backward — a blocking one,
and each linear's input-gradient all-reduce, launched before its weight gradient computes
(§4.2) and waited for after the other chunks had their turn. The parameters' gradients
accumulate as in one graph; the inputs' gradients are the chunks' joined (split inputs) or
summed (whole ones). On an accelerator the chunks' backwards run in turn instead, on the
autograd engine's device thread (a backward started on a coroutine's thread would queue its
work to that thread while it waits for the coroutines: a deadlock); the forward stays a
wavefront.

Which arguments are split: the block's first tensor argument defines the batch ``B``
(dimension 0); every tensor argument with at least two dimensions and ``B`` rows is split
along dimension 0 (hidden states, a ``[B, 1, s, s]`` mask, per-sequence position ids);
anything else — a ``[1, s, d]`` rotary table, a ``[s]`` cache position, flags — is passed
whole to every chunk. Outputs are concatenated along dimension 0 (tensors, and tuples of
them, element by element).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from atp_pipeline.errors import ConfigError
from atp_pipeline.parallel import amp
from atp_pipeline.parallel.comm import set_yield_point


class Wavefront:
    """Run ``len(thunks)`` callables as coroutines passing one baton round-robin; a
    callable yields it at each :func:`~atp_pipeline.parallel.comm.set_yield_point` call
    site (a collective). Returns their results in order; the first exception is re-raised."""

    def __init__(self, thunks: Sequence[Callable[[], Any]]) -> None:
        self.thunks = list(thunks)
        n = len(self.thunks)
        self.turn = [threading.Semaphore(0) for _ in range(n)]
        self.live = [True] * n
        self.results: List[Any] = [None] * n
        self.errors: List[Optional[BaseException]] = [None] * n
        self.finished = threading.Semaphore(0)

    def _next(self, i: int) -> Optional[int]:
        n = len(self.live)
        for j in range(1, n + 1):
            if self.live[(i + j) % n]:
                return (i + j) % n
        return None

    def _pass(self, i: int) -> None:
        """Chunk ``i`` at a collective: the next live chunk runs; ``i`` resumes when the baton returns."""
        j = self._next(i)
        if j is None or j == i:
            return
        self.turn[j].release()
        self.turn[i].acquire()

    def _body(self, i: int, state: Tuple[bool, bool, int, amp.AutocastState]) -> None:
        self.turn[i].acquire()
        grad, inference, threads, autocast = state
        try:
            torch.set_num_threads(threads)  # a new thread's OpenMP team is the machine's, not the process's
            with torch.inference_mode(inference) if inference else torch.set_grad_enabled(grad), \
                    amp.entered(autocast):
                set_yield_point(lambda: self._pass(i))
                self.results[i] = self.thunks[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.errors[i] = exc
        finally:
            set_yield_point(None)
            self.live[i] = False
            j = self._next(i)
            if j is None:
                self.finished.release()
            else:
                self.turn[j].release()

    def run(self) -> List[Any]:
        state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_num_threads(), amp.state())
        if getattr(_WORKER, "index", None) is None:
            for i in range(len(self.thunks)):  # the chunks run on the pool's threads (made once)
                _worker(i).put(lambda i=i: self._body(i, state))
        else:  # a wavefront inside a chunk: threads of its own
            for i in range(len(self.thunks)):
                threading.Thread(target=self._body, args=(i, state), daemon=True).start()
        self.turn[0].release()
        self.finished.acquire()
        for exc in self.errors:
            if exc is not None:
                raise exc
        return self.results


_WORKER = threading.local()  # .index: this thread is the pool's chunk worker number ``index``
_QUEUES: List["queue.SimpleQueue[Callable[[], None]]"] = []
_POOL_LOCK = threading.Lock()


def _worker(i: int) -> "queue.SimpleQueue[Callable[[], None]]":
    """The queue of the pool's chunk thread ``i`` (started on first use, then kept: a new
    thread's first kernels pay the libraries' per-thread set-up, about a millisecond here)."""
    with _POOL_LOCK:
        while len(_QUEUES) <= i:
            q: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()

            def loop(q: "queue.SimpleQueue[Callable[[], None]]" = q, index: int = len(_QUEUES)) -> None:
                _WORKER.index = index
                while True:
                    q.get()()

            threading.Thread(target=loop, daemon=True, name=f"atp-chunk-{len(_QUEUES)}").start()
            _QUEUES.append(q)
        return _QUEUES[i]


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    _QUEUES.clear()


os.register_at_fork(after_in_child=_forget_pool)


def _rebuild(value: Any, items: List[Any]) -> Any:
    return type(value)(items) if type(value) in (tuple, list) else type(value)(*items)


def _chunk_values(value: Any, batch: int, chunks: int, slots: Optional[List["_Slot"]]) -> List[Any]:
    """``value`` for each chunk: a batch tensor (two or more dimensions, ``batch`` rows) cut
    along dim 0, anything else whole; with ``slots``, every tensor that requires grad becomes
    a leaf per chunk (recorded in ``slots``), so each chunk's backward can run on its own."""
    if isinstance(value, torch.Tensor):
        split = value.dim() >= 2 and value.shape[0] == batch
        parts = list(value.chunk(chunks, dim=0)) if split else [value] * chunks
        if slots is None or not value.requires_grad:
            return parts
        slot = _Slot(value, split, [p.detach().requires_grad_(True) for p in parts])
        slots.append(slot)
        return list(slot.leaves)
    if isinstance(value, (tuple, list)) and value:
        per = [_chunk_values(v, batch, chunks, slots) for v in value]
        return [_rebuild(value, [p[c] for p in per]) for c in range(chunks)]
    return [value] * chunks


class _Slot:
    """A tensor argument of the block that requires grad, and its leaf in each chunk."""

    def __init__(self, tensor: torch.Tensor, split: bool, leaves: List[torch.Tensor]) -> None:
        self.tensor, self.split, self.leaves = tensor, split, leaves

    def grad(self) -> Optional[torch.Tensor]:
        grads = [leaf.grad for leaf in self.leaves]
        if all(g is None for g in grads):
            return None
        grads = [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(grads, self.leaves)]
        if self.split:
            return torch.cat(grads, dim=0)
        out = grads[0]
        for g in grads[1:]:
            out = out + g
        return out


def _flatten(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flatten(v)]
    return []


def _unflatten(value: Any, tensors: List[torch.Tensor]) -> Any:
    """``value`` (chunk 0's output) with its tensors replaced, in order, by ``tensors``."""
    if isinstance(value, torch.Tensor):
        return tensors.pop(0)
    if isinstance(value, (tuple, list)):
        return _rebuild(value, [_unflatten(v, tensors) for v in value])
    return value


class _Run:
    """One chunked call of a block with gradients: the chunks' inputs (leaves) and slots, and
    once run, chunk 0's output (its structure) and every chunk's output tensors."""

    def __init__(self, forward: Callable[..., Any], pieces: List[Tuple[tuple, dict]], slots: List[_Slot]) -> None:
        self.forward, self.pieces, self.slots = forward, pieces, slots
        self.first: Any = None
        self.flat: List[List[torch.Tensor]] = []


class _ChunkedBlock(torch.autograd.Function):
    """The block's forward as a wavefront of chunks (§4.1), and its backward too: each chunk's
    graph is separate (its inputs are leaves), so in the backward the chunks again take turns
    at every collective, one chunk's gradient all-reduce in flight while another computes."""

    @staticmethod
    def forward(ctx, run: _Run, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        with torch.enable_grad():
            outs = Wavefront([lambda a=a, kw=kw: run.forward(*a, **kw) for a, kw in run.pieces]).run()
        run.first, run.flat = outs[0], [_flatten(o) for o in outs]
        flat = run.flat
        for i, t in enumerate(flat[0]):
            if t.dim() < 1 or any(f[i].shape[1:] != t.shape[1:] for f in flat):
                raise ConfigError(f"overlap chunks (§4.1): the block's output {i} ({tuple(t.shape)}) is not split "
                                  f"by the batch; use chunks=1")
        ctx.run = run
        return tuple(torch.cat([f[i].detach() for f in flat], dim=0) for i in range(len(flat[0])))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        run: _Run = ctx.run
        flat = run.flat
        sizes = [f[0].shape[0] for f in flat]
        per_chunk = [list(g.split(sizes, dim=0)) if g is not None else [None] * len(sizes) for g in grads]

        def backward_of(c: int) -> Callable[[], None]:
            def run_chunk() -> None:
                pairs = [(o, g[c]) for o, g in zip(flat[c], per_chunk) if o.requires_grad and g[c] is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            return run_chunk

        if any(t.device.type != "cpu" for f in flat for t in f):
            # On an accelerator the autograd engine runs this backward on its device thread, and a
            # backward started on another thread (a chunk's coroutine) queues its work to that same
            # thread, which is waiting here: a deadlock (found on an H100). There each chunk's graph
            # runs in turn on this thread instead (a re-entrant backward runs inline); the
            # collectives are the same, in the same order on every rank.
            for c in range(len(flat)):
                backward_of(c)()
        else:
            Wavefront([backward_of(c) for c in range(len(flat))]).run()
        run.flat = []
        return (None, *(slot.grad() for slot in run.slots))


def _first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return v
    return None


def chunked_call(forward: Callable[..., Any], chunks: int, args: tuple, kwargs: dict) -> Any:
    """``forward(*args, **kwargs)`` run on ``chunks`` pieces of the batch as a wavefront, its
    backward too when the block's inputs require grad (:class:`_ChunkedBlock`)."""
    x = _first_tensor(args, kwargs)
    if x is None:
        return forward(*args, **kwargs)
    batch = int(x.shape[0])
    if batch % chunks:
        raise ConfigError(f"overlap chunks={chunks} (§4.1) does not divide the local batch {batch}")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in _flatten([list(args), list(kwargs.values())]))
    slots: Optional[List[_Slot]] = [] if grad else None
    per_arg = [_chunk_values(a, batch, chunks, slots) for a in args]
    per_kw = {k: _chunk_values(v, batch, chunks, slots) for k, v in kwargs.items()}
    pieces = [(tuple(p[c] for p in per_arg), {k: p[c] for k, p in per_kw.items()}) for c in range(chunks)]
    if slots:
        run = _Run(forward, pieces, slots)
        joined = _ChunkedBlock.apply(run, *(s.tensor for s in slots))
        return _unflatten(run.first, list(joined))
    return _join(Wavefront([lambda a=a, kw=kw: forward(*a, **kw) for a, kw in pieces]).run())


def _join(outs: Sequence[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outs), dim=0) if first.dim() >= 1 else first
    if isinstance(first, (tuple, list)):
        return _rebuild(first, [_join([o[i] for o in outs]) for i in range(len(first))])
    return first


class _Chunked:
    """The replacement bound ``forward`` of a block: its original run by :func:`chunked_call`."""

    def __init__(self, forward: Callable[..., Any], chunks: int) -> None:
        self.inner, self.chunks = forward, chunks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return chunked_call(self.inner, self.chunks, args, kwargs)


def chunk_blocks(root: nn.Module, chunks: int) -> List[str]:
    """Run each block of ``root`` (:func:`~atp_pipeline.parallel.fsdp.block_units`) chunked
    (§4.1), in place; returns their names. Refused in one line if ``root`` has no blocks."""
    if chunks < 1:
        raise ConfigError(f"overlap chunks must be >= 1, got {chunks}")
    if chunks == 1:
        return []
    from atp_pipeline.parallel.fsdp import block_units

    units = block_units(root)
    if not units:
        raise ConfigError(f"overlap chunks={chunks} (§4.1) runs each repeated block (an element of an "
                          f"nn.ModuleList) chunked; {type(root).__name__} has none, use chunks=1")
    for _, block in units:
        if not isinstance(block.forward, _Chunked):
            block.forward = _Chunked(block.forward, chunks)  # type: ignore[method-assign]
    return [n for n, _ in units]
