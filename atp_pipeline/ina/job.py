"""Per-job setup (§5.1): workers, their aggregation hierarchy and the PS shards.

A job's ``W`` workers are partitioned into *groups*: the children of one first-level edge
switch (normally one rack's workers). With two-level aggregation (§4.1) each group is one
child of the second-level switch (the PS's ToR); workers that sit in the PS's own rack
are singleton groups whose packets start at the second level (their first edge switch
*is* the PS's ToR). Worker ``w``'s packets carry ``bitmap0 = 1 << child0(w)``,
``bitmap1 = 1 << group(w)``, ``fan_in0 = |group|``, ``fan_in1 = #groups`` (or 0 when
single-level). The PS uses the same layout to turn a packet's bitmaps back into the exact
set of workers whose contributions it carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from atp_pipeline.errors import ConfigError


@dataclass
class JobLayout:
    """Static description of one ATP job, shared by its workers and PS shards."""

    job: int
    groups: List[List[int]]  # worker ids per first-level group, child0 = position
    two_level: bool = False
    group_start_edge: Optional[List[int]] = None  # 1 = group enters at the second level
    n_ps: int = 1
    worker_hosts: List[int] = field(default_factory=list)  # address of worker w
    ps_hosts: List[int] = field(default_factory=list)  # address of shard p
    mcast_addr: int = -1
    bitmap_bits: int = 32

    def __post_init__(self) -> None:
        ids = sorted(w for g in self.groups for w in g)
        self.n_workers = len(ids)
        if ids != list(range(self.n_workers)) or self.n_workers == 0:
            raise ConfigError(f"job {self.job}: groups must partition workers 0..W-1, got {self.groups}")
        if not 0 <= self.job < 1 << 16:
            raise ConfigError(f"job id {self.job} does not fit 16 bits")
        if max(len(g) for g in self.groups) > self.bitmap_bits:
            raise ConfigError(f"job {self.job}: a group exceeds the {self.bitmap_bits}-bit bitmap")
        if self.two_level and len(self.groups) > self.bitmap_bits:
            raise ConfigError(f"job {self.job}: {len(self.groups)} groups exceed the "
                              f"{self.bitmap_bits}-bit level-1 bitmap")
        if not 1 <= self.n_ps <= 4:
            raise ConfigError(f"job {self.job}: n_ps={self.n_ps} must be 1..4 (2-bit ps_index)")
        if self.group_start_edge is None:
            self.group_start_edge = [0] * len(self.groups)
        self.group_of = [0] * self.n_workers
        self.child0 = [0] * self.n_workers
        self.group_mask: List[int] = []
        for g, members in enumerate(self.groups):
            m = 0
            for c, w in enumerate(members):
                self.group_of[w] = g
                self.child0[w] = c
                m |= 1 << w
            self.group_mask.append(m)
        self.full_mask = (1 << self.n_workers) - 1

    @property
    def fan_in1(self) -> int:
        return len(self.groups) if self.two_level else 0

    def content_mask(self, agg1: int, worker_id: int, bitmap0: int, bitmap1: int) -> Optional[int]:
        """The set of workers (bit ``w``) whose contributions a gradient packet carries,
        or ``None`` if the bitmaps do not fit this layout."""
        if agg1:
            if bitmap1 == 0 or bitmap1 >> len(self.groups):
                return None
            m, c = 0, 0
            b = bitmap1
            while b:
                if b & 1:
                    m |= self.group_mask[c]
                b >>= 1
                c += 1
            return m
        if worker_id >= self.n_workers:
            return None
        g = self.group_of[worker_id]
        members = self.groups[g]
        if bitmap0 == 0 or bitmap0 >> len(members):
            return None
        if bitmap0 == (1 << len(members)) - 1:
            return self.group_mask[g]
        m, c, b = 0, 0, bitmap0
        while b:
            if b & 1:
                m |= 1 << members[c]
            b >>= 1
            c += 1
        return m


def racks_layout(job: int, workers_per_group: Sequence[int], two_level: bool = False, **kw) -> JobLayout:
    """Contiguous worker ids split into groups of the given sizes."""
    groups, w = [], 0
    for n in workers_per_group:
        groups.append(list(range(w, w + n)))
        w += n
    return JobLayout(job=job, groups=groups, two_level=two_level, **kw)
