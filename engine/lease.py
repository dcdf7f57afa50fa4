"""A coordinator's lease taken before its first native step (a resume's native restore):
the shims serve one coordinator at a time (specs/recovery.md, "The coordinator's lease"),
and a run whose native restore ran must not then be refused its own HANDSHAKE by a stray
process that sent one meanwhile. Taken by HANDSHAKE with the run's token (which changes
nothing in a shim but its lease, and makes no driver call, so a natively CHECKPOINTED
process answers it); a lease held by another token's HANDSHAKE alone is waited out (it
holds for SNAPSHOT_LEASE_HANDSHAKE_S, then a HANDSHAKE takes it over).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Final

from .client import Endpoint, ParticipantError, call_all
from .errors import AgentError
from .wire import Op, Reply, Request, Status

# How long a lease held by a HANDSHAKE alone is waited for: the shim's default
# SNAPSHOT_LEASE_HANDSHAKE_S (10 s) and a margin.
HANDSHAKE_WINDOW_S: Final = 12.0
_PAUSE_S: Final = 0.1


class LeaseRefused(AgentError):
    """The lease could not be taken before the first native step: nothing was changed."""


def take_lease(
    endpoints: Sequence[Endpoint], timeout: float, *, before: str = "the native restore"
) -> bytes:
    """A new token holding the lease of every endpoint's shim. A shim that refuses (held
    by another) is asked again until the handshake window has passed; one still refusing
    then, or not answering, raises :class:`LeaseRefused` after what was taken is
    released."""
    token = os.urandom(16)
    deadline = time.monotonic() + min(timeout, HANDSHAKE_WINDOW_S)
    waiting = list(endpoints)
    taken: list[Endpoint] = []
    while True:
        calls = [(e, Request(Op.HANDSHAKE, authorization=token), None) for e in waiting]
        results = call_all(calls, timeout=timeout)
        refused: list[tuple[Endpoint, Reply]] = []
        for endpoint, result in zip(waiting, results, strict=True):
            if isinstance(result, ParticipantError):
                release_lease(taken, token)
                raise LeaseRefused(
                    f"the lease could not be taken before {before}: a shim did not answer:",
                    [str(result)],
                )
            if result.status is Status.OK:
                taken.append(endpoint)
            else:
                refused.append((endpoint, result))
        if not refused:
            return token
        if time.monotonic() >= deadline:
            release_lease(taken, token)
            raise LeaseRefused(
                f"the lease could not be taken before {before}: another coordinator holds "
                "a process of the group:",
                [f"{e.describe()}: {r.message}" for e, r in refused],
            )
        waiting = [e for e, _ in refused]
        time.sleep(_PAUSE_S)


def release_lease(endpoints: Sequence[Endpoint], token: bytes) -> None:
    """RELEASE with ``token`` to every endpoint: a shim whose lease another token holds
    changes nothing; what does not answer keeps it until this process is gone."""
    if endpoints:
        call_all([(e, Request(Op.RELEASE, authorization=token), None) for e in endpoints],
                 timeout=5.0)  # fmt: skip
