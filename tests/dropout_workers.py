"""Worker for tests/test_dropout.py: dropout on real gloo processes, each rank returning the
masks it drew and what it trained (plain data); the test asserts.

* :class:`Toy` — a user's model laid out by a plan of built-in styles, with a
  :class:`Probe` (dropout recording its mask) in every region of
  :mod:`atp_pipeline.parallel.rng`: after the split embedding (``split_d2``), inside a
  ``gathered`` module (``replicated``), in the attention core styled ``heads``
  (``local``), between a column-first and a row-first linear (``split_d1``), and on logits
  gathered whole (``replicated``);
* transformers GPT-2 (eager attention) and OPT (sdpa) built from tiny configs with dropout
  0.1, laid out by the HF adapter's plan, trained with SGD; GPT-2's draws recorded by a spy on
  ``torch.nn.functional.dropout`` (the functional every dropout of transformers calls).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .hf_workers import BATCH, build, token_data

P_TOY = 0.3  # the toy's dropout: near 1/2, so that equal and independent masks are far apart
P_HF = 0.1  # GPT-2's and OPT's shipped dropout
STEPS, LR = 8, 0.2  # on two batches in turn: the loss falls by about 0.4 in 8 steps
TOY_MESHES = ((1, 2, 2), (1, 1, 4), (2, 1, 2))  # (dp, d1, d2)


class Probe(nn.Module):
    """``F.dropout`` of its input, recording the mask it drew (True = kept)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.masks: List[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = F.dropout(torch.ones_like(x), self.p, self.training)
        self.masks.append(keep != 0)
        return x * keep


class Norm(nn.Module):
    """A LayerNorm and dropout, run whole by style ``gathered``: its draws are on whole tensors."""

    def __init__(self, hidden: int, p: float) -> None:
        super().__init__()
        self.ln, self.drop = nn.LayerNorm(hidden), Probe(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.ln(x))


class Core(nn.Module):
    """Softmax attention with dropout on the probabilities (style ``heads``: this rank's heads)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.drop = Probe(p)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.drop(att) @ v


class Toy(nn.Module):
    """Embedding, norm, attention, MLP and head with a :class:`Probe` in each region."""

    def __init__(self, p: float = P_TOY, vocab: int = 32, hidden: int = 16, heads: int = 4, ffn: int = 32) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.emb, self.drop_emb = nn.Embedding(vocab, hidden), Probe(p)
        self.norm = Norm(hidden, p)
        self.qkv, self.core, self.proj = nn.Linear(hidden, 3 * hidden), Core(p), nn.Linear(hidden, hidden)
        self.fc1, self.drop_mid, self.fc2 = nn.Linear(hidden, ffn), Probe(p), nn.Linear(ffn, hidden)
        self.head, self.drop_logits = nn.Linear(hidden, vocab), Probe(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        x = self.drop_emb(self.emb(idx))
        qkv = self.qkv(self.norm(x)).view(b, s, -1, 3, self.head_dim)  # (heads, 3, head_dim), as the GPT
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        x = x + self.proj(self.core(q, k, v).transpose(1, 2).reshape(b, s, -1))
        x = x + self.fc2(self.drop_mid(torch.relu(self.fc1(x))))
        return self.drop_logits(self.head(x))


_S = "input=split, output=split"
TOY_PLAN = {"emb": "embedding(output=split)", "norm": f"gathered({_S})", "qkv": f"column({_S})",
            "core": "heads", "proj": f"row({_S})", "fc1": f"column({_S})", "fc2": f"row({_S})",
            "head": "column(input=split, output=full)"}
# the region each probe draws in (rng module docstring)
TOY_REGIONS = {"drop_emb": "split_d2", "norm.drop": "replicated", "core.drop": "local", "drop_mid": "split_d1",
               "drop_logits": "replicated"}


def _coordinate(mesh: Any) -> Dict[str, int]:
    return {n: int(c) for n, c in zip(mesh.mesh_dim_names, mesh.get_coordinate())}


def toy_case(shape: Tuple[int, int, int], device: str = "cpu") -> Dict[str, Any]:
    """Two training forwards of the laid-out toy: each probe's masks, and whether the caller's
    generator drew what it would have without the model (also after a forward that raised).
    ``device="cuda"``: the toy, batch and mesh on this rank's GPU, dropout drawing from the
    CUDA generator (ranks may share one GPU over gloo); the masks come back on the CPU."""
    from atp_pipeline.parallel import rng
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.mesh import init_mesh

    cuda = device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    get_state = torch.cuda.get_rng_state if cuda else torch.get_rng_state
    set_state = torch.cuda.set_rng_state if cuda else torch.set_rng_state
    mesh = init_mesh(shape, device_type=device)
    torch.manual_seed(0)
    model = Toy().to(dev)
    torch.manual_seed(7)
    apply_plan(model, TOY_PLAN, mesh)
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(5 + _coordinate(mesh)["dp"])).to(dev)
    before = get_state()
    for _ in range(2):
        model(idx).sum().backward()
    after_model = torch.rand(8, device=dev)
    set_state(before)
    untouched = bool(torch.equal(after_model, torch.rand(8, device=dev)))
    before = get_state()
    try:
        # out of the vocabulary: the embedding raises inside the laid-out forward (on CUDA, float
        # indices: an out-of-range index there is a device-side assert that ends the process)
        model(idx.float() if cuda else idx + 1000)
        raised = False
    except (IndexError, RuntimeError):
        raised = True
    restored = raised and torch.equal(before, get_state()) and not rng._ACTIVE
    masks = {name: [m.cpu().clone() for m in model.get_submodule(name).masks[:2]] for name in TOY_REGIONS}
    return {"mesh": shape, "coord": _coordinate(mesh), "masks": masks, "untouched": untouched,
            "restored": bool(restored)}


def toy_cases(rank: int, world: int, device: str = "cpu") -> Dict[str, Any]:
    """:func:`toy_case` on every mesh of :data:`TOY_MESHES`, in one launch."""
    return {"toy": [toy_case(shape, device) for shape in TOY_MESHES]}


@contextmanager
def dropout_spy(record: List[Tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Every ``F.dropout`` in training records ``(valid, kept)``: positions whose input is not
    zero (causally masked attention probabilities are) and those of them it kept."""
    real = F.dropout

    def spy(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        valid = x != 0
        out = real(x, p, training, inplace)
        if training and p > 0:
            record.append((valid, out != 0))
        return out

    F.dropout = spy  # type: ignore[assignment]
    try:
        yield
    finally:
        F.dropout = real  # type: ignore[assignment]


def _locals(model: nn.Module, grad: bool) -> Dict[str, Tuple[torch.Tensor, Tuple[str, ...]]]:
    """Each parameter's (or gradient's) local tensor and the mesh axes it is sharded over
    (a plain tensor: none; it is whole on every rank)."""
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grad else p
        if t is None:
            continue
        if isinstance(p, DTensor):
            axes = tuple(n for n, pl in zip(p.device_mesh.mesh_dim_names, p.placements) if isinstance(pl, Shard))
            out[name] = (t.to_local().detach().clone(), axes)
        else:
            out[name] = (t.detach().clone(), ())
    return out


def train_case(family: str, seed: int, chunks: int = 1, spy: bool = False, **over: Any) -> Dict[str, Any]:
    """``family`` with dropout, laid out on 2x2 by its adapter's plan with ``chunks`` and seed
    ``seed``, trained :data:`STEPS` SGD steps: losses, the first batch's loss in evaluation
    (no dropout), final parameters and gradients, and (``spy``) every mask drawn."""
    from atp_pipeline.models.adapter import find_adapters, prefixed
    from atp_pipeline.parallel.apply import apply_plan
    from atp_pipeline.parallel.mesh import init_mesh

    mesh = init_mesh((2, 2))
    model = build(family, torch.float32, **over)
    (name, adapter, sub), = find_adapters(model)
    torch.manual_seed(seed)
    apply_plan(model, prefixed(name, adapter.parallel_plan(sub)), mesh, chunks)
    data = token_data(2 * BATCH)
    model.eval()
    with torch.no_grad():
        eval_loss = model(input_ids=data[:BATCH], labels=data[:BATCH]).loss.item()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    record: List[Tuple[torch.Tensor, torch.Tensor]] = []
    losses = []
    with dropout_spy(record) if spy else _nothing():
        for step in range(STEPS):
            x = data[(step * BATCH) % len(data):][:BATCH]
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            grads = _locals(model, grad=True)
            opt.step()
            losses.append(loss.item())
    return {"family": family, "seed": seed, "chunks": chunks, "coord": _coordinate(mesh), "losses": losses,
            "eval_loss": eval_loss, "params": _locals(model, grad=False), "grads": grads, "draws": record}


@contextmanager
def _nothing() -> Iterator[None]:
    yield


HF_DROPOUT = {"gpt2": dict(resid_pdrop=P_HF, attn_pdrop=P_HF, embd_pdrop=P_HF, attn_implementation="eager"),
              "opt": dict(dropout=P_HF, attention_dropout=P_HF)}
# (family, seed, chunks): seed 1 twice (bit-for-bit reproduction), another seed, and chunks (§4.1)
HF_RUNS = (("gpt2", 1, 1), ("gpt2", 1, 1), ("gpt2", 2, 1), ("gpt2", 1, 2), ("gpt2", 1, 2), ("opt", 1, 1),
           ("opt", 1, 1))


def dropout_case(rank: int, world: int) -> Dict[str, Any]:
    """Everything test_dropout.py checks, in one launch of ``world`` = 4 processes."""
    toy = toy_cases(rank, world)["toy"]
    runs = [train_case(f, s, c, spy=i == 0, **HF_DROPOUT[f]) for i, (f, s, c) in enumerate(HF_RUNS)]
    return {"toy": toy, "runs": runs}
