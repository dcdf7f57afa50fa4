"""Progress events, and the callback API embedders receive them through.

One :class:`OpEvent` per wire op, once every participant has answered; the
phases that move bytes (SAVE/LOAD_ALLOCATIONS) add a :class:`Transfer`. A run
ends with exactly one :class:`DoneEvent` or :class:`FailedEvent`.

Throughput figures, in GB/s (10**9 bytes per second):

- ``gb_per_s``: all bytes moved over the phase's elapsed time on the
  coordinator's clock: end to end, as a user waiting for the phase sees it.
- ``copy_gb_per_s``: all bytes over the shims' summed copy time. Each
  participant reports its own bytes and copy time; the figures are summed over
  participants and divided, so a participant that copied nothing does not
  dilute it. Per-participant rates are kept in ``per_participant``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Final, TextIO

import attrs

from .errors import check_title
from .serial import shape, to_json
from .wire import HashState, HostCopy, Stats

_GB = 1e9
_NS = 1e9


def _rate(nbytes: int, seconds: float) -> float:
    # JSON has no infinity: a phase that moved nothing, or took no measurable
    # time, reports 0.0 rather than a division by zero.
    return nbytes / seconds / _GB if nbytes and seconds > 0 else 0.0


@shape(extra={"copy_gb_per_s": "copy_s"})
@attrs.frozen
class ParticipantTransfer:
    """What one participant reported moving in SAVE/LOAD_ALLOCATIONS."""

    participant: str
    pid: int
    allocation_count: int
    allocation_bytes: int
    shim_elapsed_s: float
    copy_s: float
    # The kept host copy (SNAPSHOT_SHIM_KEEP_HOST_COPY): the bytes this participant's
    # SAVE/LOAD copied and those it left because they had not changed, and why a SAVE
    # copied everything when its hash could not run. Without it every byte is copied.
    kept: bool = False
    bytes_copied: int = 0
    bytes_unchanged: int = 0
    note: str = ""

    @property
    def copy_gb_per_s(self) -> float:
        return _rate(self.allocation_bytes, self.copy_s)


@attrs.frozen
class Transfer:
    """The team's figures for one SAVE/LOAD_ALLOCATIONS phase."""

    allocation_count: int
    allocation_bytes: int
    gb_per_s: float
    copy_gb_per_s: float
    per_participant: tuple[ParticipantTransfer, ...] = ()
    # Over every participant: the bytes copied (all of allocation_bytes where no kept host
    # copy), those left unchanged in kept host copies, and why a SAVE copied everything.
    bytes_copied: int = 0
    bytes_unchanged: int = 0
    notes: tuple[str, ...] = ()

    @classmethod
    def from_stats(
        cls,
        stats: Sequence[tuple[str, int, Stats]],
        elapsed_s: float,
        kept: Mapping[str, tuple[HostCopy, str]] | None = None,
    ) -> Transfer:
        """Aggregate (participant, pid, stats) of every reply; ``elapsed_s`` is the phase's;
        ``kept``: by participant, the HOST_COPY record of its reply and the reply's message."""
        kept = kept or {}
        per = tuple(
            _participant(participant, pid, s, kept.get(participant))
            for participant, pid, s in stats
        )
        total = sum(p.allocation_bytes for p in per)
        return cls(
            allocation_count=sum(p.allocation_count for p in per),
            allocation_bytes=total,
            gb_per_s=_rate(total, elapsed_s),
            copy_gb_per_s=_rate(total, sum(p.copy_s for p in per if p.allocation_bytes)),
            per_participant=per,
            bytes_copied=sum(p.bytes_copied for p in per),
            bytes_unchanged=sum(p.bytes_unchanged for p in per),
            notes=tuple(f"pid {p.pid}: {p.note}" for p in per if p.note),
        )


def _participant(
    participant: str, pid: int, s: Stats, kept: tuple[HostCopy, str] | None
) -> ParticipantTransfer:
    host, message = kept if kept is not None else (None, "")
    return ParticipantTransfer(
        participant=participant,
        pid=pid,
        allocation_count=s.count,
        allocation_bytes=s.bytes,
        shim_elapsed_s=s.elapsed_ns / _NS,
        copy_s=s.copy_ns / _NS,
        kept=host is not None,
        bytes_copied=host.copied if host is not None else s.bytes,
        bytes_unchanged=host.unchanged if host is not None else 0,
        note=message if host is not None and host.hash is HashState.UNAVAILABLE else "",
    )


@attrs.frozen
class NativeKept:
    """What INSPECT says the native checkpoint keeps of the allocations the shims track:
    the ones their processes created and the shims do not stage (private ones with
    SNAPSHOT_SHIM_STAGE_PRIVATE=0, every one in content mode native), summed over the
    team. Memory the shims do not track (contexts, modules, pools) is not counted."""

    allocation_count: int
    allocation_bytes: int


_TRANSFER: Final = {
    name: name
    for name in (
        "allocation_count", "allocation_bytes", "gb_per_s", "copy_gb_per_s", "per_participant",
        "bytes_copied", "bytes_unchanged", "notes",
    )
}  # fmt: skip


@shape(
    tag={"event": "phase"},
    flatten={
        "transfer": _TRANSFER,
        "native_kept": {
            "allocation_count": "native_kept_allocations",
            "allocation_bytes": "native_kept_bytes",
        },
    },
)
@attrs.frozen
class OpEvent:
    """A wire op completed on every participant."""

    machine: str
    phase: str
    elapsed_s: float
    participants: int
    transfer: Transfer | None = None
    native_kept: NativeKept | None = None  # INSPECT only


@shape(
    rename={"allocation_count": "staged_allocations", "allocation_bytes": "staged_bytes"},
    flatten={
        "native_kept": {
            "allocation_count": "native_tracked_allocations",
            "allocation_bytes": "native_tracked_bytes",
        }
    },
)
@attrs.frozen
class StagingSummary:
    """What a suspend or resume says about the bytes: how many the shims staged
    (SAVE_ALLOCATIONS, or LOAD_ALLOCATIONS), in how long, and how many bytes of the
    allocations they track they left to the native checkpoint."""

    allocation_count: int
    allocation_bytes: int
    seconds: float
    gb_per_s: float
    native_kept: NativeKept
    # Of allocation_bytes: those the shims copied and those their kept host copies
    # already held (SNAPSHOT_SHIM_KEEP_HOST_COPY; without it, all copied), and why a
    # SAVE copied everything where its hash could not run.
    bytes_copied: int = 0
    bytes_unchanged: int = 0
    kept: bool = False
    notes: tuple[str, ...] = ()

    @classmethod
    def from_phases(cls, phases: Sequence[OpEvent]) -> StagingSummary | None:
        """From a capture's or a restore's phase events; None when none moved bytes."""
        moved = next((p for p in phases if p.transfer is not None), None)
        if moved is None or moved.transfer is None:
            return None
        kept = next((p.native_kept for p in phases if p.native_kept is not None), None)
        t = moved.transfer
        return cls(
            t.allocation_count,
            t.allocation_bytes,
            moved.elapsed_s,
            t.gb_per_s,
            kept or NativeKept(0, 0),
            t.bytes_copied,
            t.bytes_unchanged,
            any(p.kept for p in t.per_participant),
            t.notes,
        )

    def human(self) -> str:
        return (
            f"staged by the shims: {_count(self.allocation_count, 'allocation')},"
            f" {_size(self.allocation_bytes)} in {self.seconds:.3f} s ({self.gb_per_s:.2f} GB/s);"
            " left to the native checkpoint:"
            f" {_count(self.native_kept.allocation_count, 'tracked allocation')},"
            f" {_size(self.native_kept.allocation_bytes)} (plus what the shims"
            " do not track: contexts, modules, pools)"
            + (
                f"; kept host copies: {_size(self.bytes_copied)} copied,"
                f" {_size(self.bytes_unchanged)} unchanged"
                if self.kept
                else ""
            )
            + "".join(f"; copied everything, {note}" for note in self.notes)
        )


@attrs.frozen
class PendingParticipant:
    """A participant not quiet yet after a QUIESCE round: its gate stays closed."""

    participant: str
    pid: int
    held_threads: int
    message: str


@shape(tag={"event": "quiesce_round"})
@attrs.frozen
class QuiesceRound:
    """One QUIESCE round answered (specs/quiesce.md): who is quiet, who is not yet.

    ``round`` counts from 1; ``length_s`` is the time the round gave each shim,
    ``elapsed_s`` the time since the first round began.
    """

    machine: str
    round: int
    length_s: float
    elapsed_s: float
    quiet: tuple[str, ...]
    pending: tuple[PendingParticipant, ...]


@shape(tag={"event": "done"})
@attrs.frozen
class DoneEvent:
    """The machine reached its final state."""

    machine: str
    elapsed_s: float
    participants: int
    checkpoint_dir: str


@shape(tag={"event": "failed"}, omit=frozenset({"check", "rules"}), extra={"check_title": "check"})
@attrs.frozen
class FailedEvent:
    """The machine stopped: ``kind`` is "refused" (nothing changed) or "failed"."""

    machine: str
    kind: str
    phase: str
    participant: str | None
    pid: int | None
    reason: str
    elapsed_s: float
    problems: tuple[str, ...] = ()
    # The guard that refused or failed ("": an op's own failure; a refusal's ``phase`` is
    # the step it guards, whose op was not sent) and the validation rules behind it.
    check: str = ""
    rules: tuple[str, ...] = ()

    @property
    def check_title(self) -> str:
        return check_title(self.check)

    def headline(self) -> str:
        """Where the machine stopped, in a person's words: a refusal names its check."""
        if self.kind == "refused" and self.check:
            return f"{self.machine} refused by {check_title(self.check)}"
        return f"{self.machine} {self.kind} at {self.phase}"


Event = OpEvent | QuiesceRound | DoneEvent | FailedEvent
ProgressCallback = Callable[[Event], None]


def json_line(event: Event) -> str:
    return json.dumps(to_json(event), sort_keys=False, allow_nan=False)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_line(event: Event) -> str:
    if isinstance(event, OpEvent):
        text = (
            f"{event.machine} {event.phase}: {event.elapsed_s * 1e3:.1f} ms, "
            f"{event.participants} participant{'s' if event.participants != 1 else ''}"
        )
        if event.transfer is not None:
            t = event.transfer
            text += (
                f", {t.allocation_count} allocation{'s' if t.allocation_count != 1 else ''}"
                f" ({_size(t.allocation_bytes)}), {t.gb_per_s:.2f} GB/s end to end,"
                f" {t.copy_gb_per_s:.2f} GB/s copying"
            )
        return text
    if isinstance(event, QuiesceRound):
        text = (
            f"{event.machine} QUIESCE round {event.round}: {len(event.quiet)} quiet, "
            f"{len(event.pending)} not yet, {event.elapsed_s * 1e3:.1f} ms"
        )
        return text + "".join(f"; pid {p.pid}: {p.message}" for p in event.pending)
    if isinstance(event, DoneEvent):
        return (
            f"{event.machine} done in {event.elapsed_s:.3f} s "
            f"({_count(event.participants, 'participant')}, {event.checkpoint_dir})"
        )
    who = ""
    if event.participant:
        who += f" participant {event.participant}"
    if event.pid is not None:
        who += f" (pid {event.pid})"
    return f"{event.headline()}:{who} {event.reason}"


def json_printer(stream: TextIO) -> ProgressCallback:
    """A callback printing one JSON object per line to ``stream``, flushed per event."""

    def emit(event: Event) -> None:
        stream.write(json_line(event) + "\n")
        stream.flush()

    return emit
