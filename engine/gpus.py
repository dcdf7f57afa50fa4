"""The GPUs of a group and the mapping of a restore onto other GPUs (``--gpu-map``).

A suspend records, per process, the GPUs it used (:class:`Gpu`: ordinal, UUID, chip
name, the bytes it created there), from each shim's devices report (STATUS
``ask_devices``, protocol.h ``CUIP_ASK_DEVICES``). A restore given a :class:`GpuMap`
(``OLD=NEW[,OLD=NEW...]``, each an ordinal or a ``GPU-...`` UUID; an old ordinal is
the checkpointed node's, a new one the restoring node's) resolves it to UUID pairs
with :func:`resolve`, which refuses, before anything changes and naming the GPU, a
map that misses a checkpointed GPU, names one twice, or targets a GPU that is not
here, of another chip, or with less memory than the group used there. The pairs go
to the native restore (``gpuPairs``) and, as text (:func:`wire_text`), to every
shim's LOAD_ALLOCATIONS, which checks that each GPU it used is the mapped one now
(specs/restore.md, "Onto other GPUs").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Final

import attrs

from .errors import AgentError

UUID_PATTERN: Final = re.compile(
    r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
)
_ORDINAL: Final = re.compile(r"0|[1-9][0-9]{0,2}")
_REPORT_MAX_LINES: Final = 64


class GpuMapError(ValueError):
    """A ``--gpu-map`` that is not ``OLD=NEW[,OLD=NEW...]``."""


class GpuMapRefused(AgentError):
    """A mapping that the restore refuses: nothing was changed."""


@attrs.frozen
class Gpu:
    """A GPU a process used (or one of the restoring node's): its ordinal there, its
    UUID, its chip's name, and the bytes (the process created there; the node's: its
    total memory)."""

    ordinal: int
    uuid: str
    name: str = ""
    bytes: int = 0

    def describe(self) -> str:
        chip = f" ({self.name})" if self.name else ""
        return f"GPU {self.ordinal} {self.uuid}{chip}"


def uuid_text(raw: bytes) -> str:
    """A CUuuid's 16 bytes as ``GPU-8-4-4-4-12``."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID is 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def uuid_bytes(text: str) -> bytes:
    if not UUID_PATTERN.fullmatch(text):
        raise ValueError(f"{text!r} is not a GPU-... UUID")
    return bytes.fromhex(text[4:].replace("-", ""))


def parse_report(text: str) -> tuple[Gpu, ...]:
    """A shim's devices report (one ``ordinal\\tuuid\\tbytes\\tname`` line a GPU); a
    shim's answer is hostile: anything else raises ValueError."""
    lines = text.splitlines()
    if len(lines) > _REPORT_MAX_LINES:
        raise ValueError(f"the devices report has {len(lines)} lines")
    gpus: list[Gpu] = []
    for line in lines:
        fields = line.split("\t")
        if len(fields) != 4 or not _ORDINAL.fullmatch(fields[0]):
            raise ValueError(f"devices report line {line!r} is not ordinal, UUID, bytes, name")
        if not UUID_PATTERN.fullmatch(fields[1]) or not fields[2].isdigit():
            raise ValueError(f"devices report line {line!r} has no UUID or byte count")
        gpus.append(Gpu(int(fields[0]), fields[1], fields[3], int(fields[2])))
    if len({g.ordinal for g in gpus}) != len(gpus):
        raise ValueError("the devices report names an ordinal twice")
    return tuple(gpus)


@attrs.frozen
class GpuMap:
    """``OLD=NEW`` pairs as given: each side an ordinal (as text) or a ``GPU-`` UUID."""

    pairs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> GpuMap:
        pairs: list[tuple[str, str]] = []
        for item in text.split(","):
            old, eq, new = item.strip().partition("=")
            if not eq or not _gpu_ref(old) or not _gpu_ref(new):
                raise GpuMapError(
                    f"--gpu-map {text!r}: {item!r} is not OLD=NEW (each an ordinal or a "
                    "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx UUID)"
                )
            pairs.append((old.strip(), new.strip()))
        return cls(tuple(pairs))

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def describe(self) -> str:
        return ",".join(f"{o}={n}" for o, n in self.pairs)


def _gpu_ref(text: str) -> bool:
    text = text.strip()
    return bool(_ORDINAL.fullmatch(text) or UUID_PATTERN.fullmatch(text))


def checkpointed(recorded: Iterable[Sequence[Gpu]]) -> tuple[Gpu, ...]:
    """The group's GPUs, once each by UUID (bytes summed over its processes), by ordinal."""
    by_uuid: dict[str, Gpu] = {}
    for gpus in recorded:
        for gpu in gpus:
            held = by_uuid.get(gpu.uuid)
            by_uuid[gpu.uuid] = (
                gpu if held is None else attrs.evolve(held, bytes=held.bytes + gpu.bytes)
            )
    return tuple(sorted(by_uuid.values(), key=lambda g: (g.ordinal, g.uuid)))


def _find(ref: str, gpus: Sequence[Gpu], where: str) -> Gpu | str:
    """The GPU ``ref`` names among ``gpus``, or why none."""
    if UUID_PATTERN.fullmatch(ref):
        found = [g for g in gpus if g.uuid == ref]
    else:
        found = [g for g in gpus if g.ordinal == int(ref)]
    if len(found) == 1:
        return found[0]
    if not found:
        return f"{ref} is no GPU {where}"
    return f"ordinal {ref} names more than one GPU {where}: give UUIDs"


def resolve(
    gpu_map: GpuMap, old: Sequence[Gpu], here: Sequence[Gpu]
) -> tuple[tuple[str, str], ...]:
    """``gpu_map`` as (old UUID, new UUID) pairs (:func:`resolve_gpus`)."""
    return tuple((was.uuid, now.uuid) for was, now in resolve_gpus(gpu_map, old, here))


def resolve_gpus(
    gpu_map: GpuMap, old: Sequence[Gpu], here: Sequence[Gpu]
) -> tuple[tuple[Gpu, Gpu], ...]:
    """``gpu_map`` as (old GPU, new GPU) pairs; ``old``: the group's checkpointed GPUs
    (:func:`checkpointed`), ``here``: the restoring node's (total memory in ``bytes``).
    Raises :class:`GpuMapRefused` with every problem, each said once, naming each GPU."""
    problems: list[str] = []
    pairs: list[tuple[Gpu, Gpu]] = []
    named: set[str] = set()  # the old GPUs the map names, whether or not their target is here
    for old_ref, new_ref in gpu_map.pairs:
        was = _find(old_ref, old, "the group used (manifest)")
        now = _find(new_ref, here, "here")
        for found in (was, now):
            if isinstance(found, str):
                problems.append(found)
        if isinstance(was, Gpu):
            named.add(was.uuid)
        if isinstance(was, Gpu) and isinstance(now, Gpu):
            pairs.append((was, now))
    for label, side in (("checkpointed", 0), ("target", 1)):
        seen: dict[str, int] = {}
        for pair in pairs:
            seen[pair[side].uuid] = seen.get(pair[side].uuid, 0) + 1
        problems += [f"{label} GPU {u} is named {n} times" for u, n in seen.items() if n > 1]
    problems += [
        f"{g.describe()} is missing: the mapping must name every GPU the group used"
        for g in old
        if g.uuid not in named
    ]
    for was, now in pairs:
        if was.name and now.name and was.name != now.name:
            problems.append(f"{was.describe()} cannot go to {now.describe()}: another chip")
        if now.bytes and was.bytes > now.bytes:
            problems.append(
                f"{was.describe()} cannot go to {now.describe()}: the group used "
                f"{was.bytes} bytes there, the GPU has {now.bytes}"
            )
    if problems:
        raise GpuMapRefused(
            f"--gpu-map {gpu_map.describe()} refused (nothing was changed):", problems
        )
    return tuple(pairs)


def uuid_pairs(gpu_map: GpuMap) -> tuple[tuple[str, str], ...]:
    """``gpu_map`` as it stands, for a coordinator restore whose native restore ran
    elsewhere (the driver refused what it would not take): UUIDs only, each once;
    every shim's LOAD checks the rest (a GPU it used and the mapping misses, one it
    never saw)."""
    problems = [
        f"{ref} is an ordinal: without the native restore here, name GPUs by UUID"
        for pair in gpu_map.pairs
        for ref in pair
        if not UUID_PATTERN.fullmatch(ref)
    ]
    for side, label in ((0, "checkpointed"), (1, "target")):
        names = [pair[side] for pair in gpu_map.pairs]
        problems += [f"{label} GPU {u} is named twice" for u in sorted(set(names))
                     if names.count(u) > 1]  # fmt: skip
    if problems:
        raise GpuMapRefused(
            f"--gpu-map {gpu_map.describe()} refused (nothing was changed):", problems
        )
    return gpu_map.pairs


def wire_text(pairs: Sequence[tuple[str, str]]) -> str:
    """The pairs as LOAD_ALLOCATIONS carries them (protocol.h)."""
    return ",".join(f"{old}={new}" for old, new in pairs)
