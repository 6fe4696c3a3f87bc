"""Data modules: the shipped byte-level corpus, and synthetic tokens for paper-size models.

Both datasets are indexed by sample number and deterministic in it (a seeded permutation of
corpus windows, or seeded random tokens), and the loaders do not shuffle: the order of
batches is the same whatever the process count, so a tensor-parallel run sees exactly the
single-process run's batches, data-parallel replicas split each global batch (strided, as
a non-shuffling ``DistributedSampler`` splits it), and a resumed run continues at the sample
where the checkpoint stopped — whatever ``max_steps`` it resumes with: the loader's length
is the whole run (Lightning counts the restored batches of the epoch against it), and it
yields the batches from the restored step on (:class:`RunSampler`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from atp_pipeline.data import CORPUS
from atp_pipeline.errors import ConfigError


class CorpusWindows(Dataset):
    """``(x, y)`` windows of ``seq_len`` bytes, y shifted by one, in a seeded order."""

    def __init__(self, path: Path, seq_len: int, seed: int, start: int = 0, length: int = 10**9) -> None:
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
        if len(data) < seq_len + 2:
            raise ConfigError(f"corpus {path} has {len(data)} bytes, fewer than seq_len+2 = {seq_len + 2}")
        self.data, self.seq_len, self.start, self.length = data, seq_len, start, length
        g = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(data) - seq_len - 1, generator=g)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        k = int(self.order[(self.start + i) % len(self.order)])
        w = self.data[k:k + self.seq_len + 1]
        return w[:-1], w[1:]


class SyntheticTokens(Dataset):
    """Seeded random tokens (for paper-size models, whose throughput is what is measured)."""

    def __init__(self, vocab: int, seq_len: int, seed: int, start: int = 0, length: int = 10**9) -> None:
        self.vocab, self.seq_len, self.seed, self.start, self.length = vocab, seq_len, seed, start, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.start + i)
        w = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
        return w[:-1], w[1:]


class RunSampler(DistributedSampler):
    """This replica's sample indices of a run's batches ``first_batch..`` of ``batch`` samples
    (strided over ``replicas``, as a non-shuffling ``DistributedSampler`` splits a batch); its
    length counts the whole run from batch 0, which is how Lightning numbers the batches of
    the one epoch a run is, including restored ones.

    It is a ``DistributedSampler`` because it already gives each replica its share: Lightning
    (both packages) leaves a loader's ``DistributedSampler`` alone, where it would wrap any
    other sampler in a shuffling ``DistributedSamplerWrapper`` that splits the replica's
    share again — each replica would see 1/dp of its share, reshuffled,
    and the run would end its "epoch" dp times early."""

    def __init__(self, first_batch: int, batches: int, batch: int, replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(batches * batch), num_replicas=replicas, rank=rank, shuffle=False, drop_last=True)
        self.first, self.total = first_batch * batch, batches * batch

    def __iter__(self):
        return iter(range(self.first + self.rank, self.total, self.num_replicas))

    def __len__(self) -> int:
        return self.total // self.num_replicas


class TokenDataMixin:
    """``source="corpus"`` (bytes of the shipped text, vocab 256) or ``"synthetic"``.

    ``batch_size`` is the global batch; each data-parallel replica loads its share. On
    resume, :meth:`train_dataloader` starts at ``global_step * batch_size``.
    """

    def __init__(self, source: str, seq_len: int, batch_size: int, vocab_size: int = 256, seed: int = 0,
                 path: Optional[Path] = None) -> None:
        super().__init__()
        if source not in ("corpus", "synthetic"):
            raise ConfigError(f"data.source must be 'corpus' or 'synthetic', got {source!r}")
        if source == "corpus" and vocab_size < 256:
            raise ConfigError(f"the byte-level corpus needs vocab_size >= 256, got {vocab_size}")
        self.source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.vocab_size, self.seed, self.path = vocab_size, seed, path or CORPUS

    def _replica(self) -> Tuple[int, int]:
        trainer = self.trainer
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer else None
        return (int(kwargs["num_replicas"]), int(kwargs["rank"])) if kwargs else (1, 0)

    def train_dataloader(self) -> DataLoader:
        # The sampler is ours: Lightning would otherwise inject a *shuffling* DistributedSampler
        # for training, whose order depends on the dataset length (and so on max_steps).
        replicas, rank = self._replica()
        if self.batch_size % replicas:
            raise ConfigError(f"global batch {self.batch_size} does not split over {replicas} data-parallel replicas")
        trainer = self.trainer
        step = trainer.global_step if trainer else 0
        # one "epoch" = the run
        steps = max(step + 1, trainer.max_steps if trainer and trainer.max_steps > 0 else 10_000)
        length = steps * self.batch_size
        if self.source == "corpus":
            ds: Dataset = CorpusWindows(self.path, self.seq_len, self.seed, 0, length)
        else:
            ds = SyntheticTokens(self.vocab_size, self.seq_len, self.seed, 0, length)
        sampler = RunSampler(step, steps, self.batch_size, replicas, rank)
        return DataLoader(ds, batch_size=self.batch_size // replicas, sampler=sampler, num_workers=0)
