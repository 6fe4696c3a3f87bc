"""Tenants of one live role: which job belongs to whom, and who may do what on the control channel.

Several training runs may share one switch (``aggregation.switch=host:port``), each a tenant.
Every client holds the role's secret (:mod:`.auth`); what tells the tenants apart is a token:

* job setup (ATP §5.1, ``add_job``) binds the new job to the token presented with it —
  the tenant's, one random token per training run (:attr:`.services.Services.tenant`);
* every later operation on that job (teardown, the stall report, the shared-memory
  segment) must present the same token, compared with :func:`hmac.compare_digest`; so must
  ``add_job`` for a job id someone has used before on this role;
* ``stats`` shows a tenant its own jobs only (the counters of the role as a whole stay);
* the role's *owner* token — generated when the role starts, printed only in its start
  line, i.e. to the process that started it — may do everything: ``shutdown``, ``cpu``,
  every job's ``stats``.

A job's binding outlives its teardown, so its tenant can read its final counters, and a
switch picks job ids never used before (:meth:`Tenants.new_id`): another tenant never sees
a finished job's counters under its own job's id.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any, Callable, Dict, Optional, Set

from atp_pipeline.ina.live.rpc import OPS


class Tenants:
    """Job → tenant token bindings of one role, and the access rules of :data:`~.rpc.OPS`."""

    def __init__(self) -> None:
        self.owner = secrets.token_hex(16)  # the role's owner token (its start line)
        self._jobs: Dict[int, str] = {}

    def is_owner(self, token: Optional[str]) -> bool:
        return token is not None and hmac.compare_digest(token, self.owner)

    def owns(self, token: Optional[str], job: Any) -> bool:
        """Whether ``token`` may act on ``job`` (its tenant's token, or the owner's)."""
        bound = self._jobs.get(job) if type(job) is int else None
        return bound is not None and token is not None and (hmac.compare_digest(token, bound) or self.is_owner(token))

    def jobs_of(self, token: Optional[str]) -> Optional[Set[int]]:
        """The jobs ``token`` may see: ``None`` (all) for the owner, else its tenant's."""
        if self.is_owner(token):
            return None
        if token is None:
            raise PermissionError("stats needs a tenant token (that of the jobs to read) or the role's owner token")
        return {j for j, t in self._jobs.items() if hmac.compare_digest(t, token)}

    def new_id(self, taken: Callable[[int], bool], limit: int = 1 << 16) -> int:
        """The smallest job id in ``1..limit-1`` that no tenant has used on this role and
        ``taken`` does not reject."""
        for j in range(1, limit):
            if j not in self._jobs and not taken(j):
                return j
        raise ValueError(f"every job id 1..{limit - 1} has been used on this role: restart it")

    def authorize(self, op: str, args: Dict[str, Any], token: Optional[str]) -> Optional[Set[int]]:
        """Refuse (:class:`PermissionError`) ``op`` unless ``token`` may run it; for ``stats``
        the jobs it may see (``None``: all)."""
        rule = OPS[op]
        if rule == "any":
            return None
        if rule == "owner":
            if not self.is_owner(token):
                raise PermissionError(f"{op} needs the role's owner token")
            return None
        if rule == "stats":
            return self.jobs_of(token)
        if token is None:
            raise PermissionError(f"{op} needs the tenant token the job was set up with")
        job = args.get("job")
        if rule == "setup":
            if job is not None and job in self._jobs and not self.owns(token, job):
                raise PermissionError(f"job {job} belongs to another tenant of this role")
            return None
        if not self.owns(token, job):
            raise PermissionError(f"{op}: no job {job} of this tenant on this role")
        return None

    def bind(self, job: int, token: str) -> None:
        """``job`` was set up with ``token``."""
        self._jobs[job] = token
