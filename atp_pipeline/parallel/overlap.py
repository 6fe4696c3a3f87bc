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

Coroutines are threads of which exactly one runs at a time (a baton passed round-robin):
the order in which collectives are issued is the same on every rank (the schedule is a
function of the code alone), and each chunk's autograd graph is built as the chunk runs.
The backward pass needs no help: §4.2's overlap (each input-gradient all-reduce in flight
while the weight gradient computes) is :class:`~atp_pipeline.parallel.mappings.LinearAllReduce`'s.

Which arguments are split: the block's first tensor argument defines the batch ``B``
(dimension 0); every tensor argument with at least two dimensions and ``B`` rows is split
along dimension 0 (hidden states, a ``[B, 1, s, s]`` mask, per-sequence position ids);
anything else — a ``[1, s, d]`` rotary table, a ``[s]`` cache position, flags — is passed
whole to every chunk. Outputs are concatenated along dimension 0 (tensors, and tuples of
them, element by element).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from atp_pipeline.errors import ConfigError
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

    def _body(self, i: int, state: Tuple[bool, bool]) -> None:
        self.turn[i].acquire()
        grad, inference = state
        try:
            with torch.inference_mode(inference) if inference else torch.set_grad_enabled(grad):
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
        state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        threads = [threading.Thread(target=self._body, args=(i, state), daemon=True, name=f"atp-chunk-{i}")
                   for i in range(len(self.thunks))]
        for t in threads:
            t.start()
        self.turn[0].release()
        self.finished.acquire()
        for t in threads:
            t.join()
        for exc in self.errors:
            if exc is not None:
                raise exc
        return self.results


def _split(value: Any, batch: int, chunks: int) -> Optional[List[Any]]:
    """``value`` cut into ``chunks`` along dim 0 if it is a batch tensor (or a tuple/list holding one)."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch:
            return list(value.chunk(chunks, dim=0))
        return None
    if isinstance(value, (tuple, list)) and value:
        parts = [_split(v, batch, chunks) for v in value]
        if any(p is not None for p in parts):
            return [type(value)(p[c] if p is not None else v for p, v in zip(parts, value)) for c in range(chunks)]
    return None


def _join(outs: Sequence[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outs), dim=0) if first.dim() >= 1 else first
    if isinstance(first, (tuple, list)):
        return type(first)(_join([o[i] for o in outs]) for i in range(len(first)))
    return first


def _first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return v
    return None


def chunked_call(forward: Callable[..., Any], chunks: int, args: tuple, kwargs: dict) -> Any:
    """``forward(*args, **kwargs)`` run on ``chunks`` pieces of the batch as a wavefront."""
    x = _first_tensor(args, kwargs)
    if x is None:
        return forward(*args, **kwargs)
    batch = int(x.shape[0])
    if batch % chunks:
        raise ConfigError(f"overlap chunks={chunks} (§4.1) does not divide the local batch {batch}")
    split_args = [_split(a, batch, chunks) for a in args]
    split_kwargs = {k: _split(v, batch, chunks) for k, v in kwargs.items()}

    def piece(c: int) -> Callable[[], Any]:
        a = tuple(s[c] if s is not None else v for s, v in zip(split_args, args))
        kw = {k: (split_kwargs[k][c] if split_kwargs[k] is not None else v) for k, v in kwargs.items()}
        return lambda: forward(*a, **kw)

    return _join(Wavefront([piece(c) for c in range(chunks)]).run())


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
