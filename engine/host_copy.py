"""``cuinterpose host-copy``: the kept host copy turned on in running processes, or every
copy given back (HOST_COPY, specs/shim.md "Kept host copy"), outside any run and lease.

Each process is asked HANDSHAKE (its participant id), then HOST_COPY; what each answers
(the host memory its copies hold after it, or why it refused) is one :class:`Answer`."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .client import ParticipantError, call_all
from .detection import Where, group_of
from .manifest import Process
from .serial import shape
from .wire import HostCopy, Op, Request, Status, WireError


def _held(host: HostCopy | None) -> dict[str, int] | None:
    if host is None:
        return None
    return {"bytes": host.bytes, "copies": host.count, "hash_table_bytes": host.overhead}


@shape(
    flatten={"process": {"observed_pid": "observed_pid", "namespace_pid": "namespace_pid"}},
    convert={"held": _held},
)
@attrs.frozen
class Answer:
    """One process's answer: what its kept host copies hold now, or the problem."""

    process: Process
    held: HostCopy | None
    problem: str = ""

    def describe(self, give_back: bool) -> str:
        if self.problem:
            return f"{self.process.describe()}: {self.problem}"
        assert self.held is not None
        if give_back:
            return f"{self.process.describe()}: kept host copy off, every copy given back"
        return (
            f"{self.process.describe()}: kept host copy on, {self.held.count} copies "
            f"pinned so far ({self.held.bytes:,} bytes; the rest follow in the background)"
        )


def host_copy(
    processes: Sequence[Process | tuple[int, int]],
    where: Where,
    *,
    give_back: bool,
    timeout: float = 60.0,
) -> tuple[Answer, ...]:
    """HOST_COPY to every process: KEEP, or GIVE_BACK with ``give_back``."""
    group = group_of(processes)
    endpoints = [where.endpoint(p) for p in group]
    hello = call_all([(e, Request(Op.HANDSHAKE), None) for e in endpoints], timeout=timeout)
    asks: list[tuple[int, Request, str]] = []
    out: list[Answer | None] = [None] * len(group)
    for i, (process, reply) in enumerate(zip(group, hello, strict=True)):
        if isinstance(reply, ParticipantError):
            out[i] = Answer(process, None, f"not answering: {reply.reason}")
        else:
            request = Request(Op.HOST_COPY, participant=reply.participant, give_back=give_back)
            asks.append((i, request, reply.participant))
    replies = call_all([(endpoints[i], request, who) for i, request, who in asks], timeout=timeout)
    for (i, _, _), reply in zip(asks, replies, strict=True):
        process = group[i]
        if isinstance(reply, ParticipantError):
            out[i] = Answer(process, None, f"not answering: {reply.reason}")
        elif reply.status is not Status.OK:
            out[i] = Answer(
                process, None, f"HOST_COPY answered {reply.status.name}: {reply.message}"
            )
        else:
            try:
                held = HostCopy.in_reply(reply.records)
            except WireError as exc:
                held, why = None, f"HOST_COPY's reply is malformed: {exc}"
            else:
                why = "" if held is not None else "HOST_COPY's reply carries no HOST_COPY record"
            out[i] = Answer(process, held, why)
    return tuple(a for a in out if a is not None)
