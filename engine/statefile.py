"""The state file ``cuinterpose.state``: the durable record of one capture.

Capture writes it last, into the checkpoint directory; restore reads it first, to
check that the same participants came back and, at the end, that the rebuilt
topology equals the captured one. ``specs/state-file.md`` describes the format.

It is versioned JSON produced and read through a dedicated cattrs converter that
refuses anything it does not know (keys, enum names, versions) instead of guessing.
It holds ids, sizes, addresses and flags only: never file descriptors, memory bytes
or authorization tokens (none of those is in a :class:`~.wire.Record`).
"""

from __future__ import annotations

import errno
import functools
import itertools
import json
import operator
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, NoReturn, TypeVar, get_args

import attrs

from . import wire
from .topology import ParticipantTopology, Topology
from .wire import Access, BindingKind, Record, RecordFlag, RecordKind

# cattrs is imported where a state file is written or read (make_converter, read_state):
# a command that only names the file does not load it.
if TYPE_CHECKING:
    import cattrs

STATE_FILE_NAME: Final = "cuinterpose.state"
STATE_FORMAT: Final = "cuinterpose.state"
STATE_VERSION: Final = 2
# Version 1 has no observed pid, start time nor pid namespace per participant: read as 0.
READABLE_STATE_VERSIONS: Final = (1, STATE_VERSION)
# The protocol versions whose records a state file may hold: the record layout has
# not changed since version 1, so one written by a version-1 coordinator reads the
# same (its restore then meets the shims at HANDSHAKE, which refuses another
# version before anything changes).
READABLE_PROTOCOL_VERSIONS: Final = (1, wire.VERSION)
# A record takes about 150-300 bytes, so this holds a quarter million records: far more
# than real teams report, small enough that a corrupt or hostile file is never read
# into memory whole. encode_state() lets a caller learn before any destructive op
# that the capture's state will fit.
MAX_STATE_BYTES: Final = 64 * 1024 * 1024

ContentMode = Literal["host", "native"]
CONTENT_MODES: Final[tuple[str, ...]] = get_args(ContentMode)

_PID_MAX: Final = (1 << 32) - 1
_RECORD_FLAG_VALUES: Final = tuple(RecordFlag(v) for v in range(8))
_E = TypeVar("_E", RecordKind, BindingKind)


class StateFileError(Exception):
    """A state file that cannot be written or read, naming the file and what is wrong."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"state file {path}: {problem}")
        self.path = path
        self.problem = problem


def _sorted_state_participants(
    participants: Iterable[StateParticipant],
) -> tuple[StateParticipant, ...]:
    return tuple(sorted(participants, key=lambda p: (p.participant, p.pid)))


@attrs.frozen
class StateParticipant:
    """A participant's durable id and the pid it had at capture: ``pid`` is its own (the
    namespace pid, as its shim says it), ``observed_pid`` the coordinator's (its host
    pid), ``started`` its start time (``/proc/PID/stat`` field 22, clock ticks) and
    ``pid_namespace`` its pid namespace (the inode of ``/proc/PID/ns/pid``), which tell
    the process from another one given its pid since. Version 1 files have none of
    the three: 0, not recorded."""

    participant: str
    pid: int
    observed_pid: int = 0
    started: int = 0
    pid_namespace: int = 0

    def pair(self) -> tuple[int, int]:
        """(observed, namespace): the pid twice where the observed one is not recorded."""
        return (self.observed_pid or self.pid, self.pid)


@attrs.frozen
class CheckpointState:
    """Everything the state file holds (``format`` and ``version`` frame it on disk)."""

    protocol_version: int
    content_mode: ContentMode
    created_at: str
    participants: tuple[StateParticipant, ...] = attrs.field(converter=_sorted_state_participants)
    topology: Topology


def utc_timestamp(now: datetime | None = None) -> str:
    """ISO 8601 in UTC with a ``Z``, to the millisecond."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --- the converter ------------------------------------------------------------------


class _Invalid(ValueError):
    """A value a hook refused; its text is what the error message shows."""


def _structure_int(value: object, _: type) -> int:
    # cattrs would call int(value): "12", 1.5 and true would all pass silently.
    if type(value) is not int:
        raise _Invalid(f"expected an integer, got {value!r}")
    return value


def _structure_str(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"expected a string, got {value!r}")
    return value


def _structure_resource_id(value: object, _: type) -> bytes:
    # Every bytes field in the state is a 16-byte resource id.
    if (
        not isinstance(value, str)
        or len(value) != 2 * wire.ID_LEN
        or not set(value) <= set("0123456789abcdef")
    ):
        raise _Invalid(f"resource id {value!r} is not {2 * wire.ID_LEN} lowercase hex digits")
    return bytes.fromhex(value)


def _structure_enum(value: object, enum_type: type[_E]) -> _E:
    if not isinstance(value, str) or value not in enum_type.__members__:
        names = ", ".join(enum_type.__members__)
        raise _Invalid(f"unknown {enum_type.__name__} {value!r} (known: {names})")
    return enum_type[value]


def _flag_names(flags: RecordFlag) -> list[str]:
    return [f.name for f in RecordFlag if f in flags and f.name]


# Every value of the three flags, and its names: walking the enum per record is
# most of what writing a record costs.
_FLAG_NAMES: Final = {int(flags): tuple(_flag_names(flags)) for flags in _RECORD_FLAG_VALUES}


def _unstructure_flags(flags: RecordFlag) -> list[str]:
    names = _FLAG_NAMES.get(flags) if type(flags) is RecordFlag else None
    return list(names) if names is not None else _flag_names(flags)


def _enum_name(member: RecordKind | BindingKind) -> str:
    # What member.name gives (a property lookup per record), from a table per enum
    # (one table would mix them up: RecordKind.ALLOCATION == BindingKind.BIND_MEM).
    names = _ENUM_NAMES.get(type(member))
    return names[member] if names is not None else member.name


_ENUM_NAMES: Final[dict[type, dict[Any, str]]] = {
    RecordKind: {k: k.name for k in RecordKind},
    BindingKind: {k: k.name for k in BindingKind},
}


def _structure_flags(value: object, _: type) -> RecordFlag:
    if not isinstance(value, list):
        raise _Invalid(f"flags must be a list of names, got {value!r}")
    flags = RecordFlag(0)
    for name in value:
        if not isinstance(name, str) or name not in RecordFlag.__members__:
            known = ", ".join(RecordFlag.__members__)
            raise _Invalid(f"unknown record flag {name!r} (known: {known})")
        if RecordFlag[name] in flags:
            raise _Invalid(f"record flag {name!r} listed twice")
        flags |= RecordFlag[name]
    return flags


def _structure_content_mode(value: object, _: object) -> str:
    if value not in CONTENT_MODES:
        raise _Invalid(f"content_mode {value!r} is not one of {', '.join(CONTENT_MODES)}")
    assert isinstance(value, str)
    return value


def _lists_only(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    # cattrs structures a tuple from any iterable; a dict or a string where a list
    # belongs is a corrupt file, not something to iterate.
    def structure(value: object, type_: Any) -> Any:
        if not isinstance(value, list):
            raise _Invalid(f"expected a list, got {type(value).__name__}")
        return hook(value, type_)

    return structure


def _is_type(expected: object) -> Callable[[Any], bool]:
    # Generic aliases (tuple[X, ...], Literal[...]) are not classes: dispatch by equality.
    return lambda candidate: bool(candidate == expected)


def make_converter() -> cattrs.Converter:
    """The converter for the state file: strict in, readable out.

    Enums by name, flags as a list of names, resource ids as hex, records without
    their zero/default fields; unknown keys, names and non-integer numbers refused.
    A new converter per call, so no caller can change another's.
    """
    import cattrs
    from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(str, _structure_str)
    conv.register_unstructure_hook(bytes, bytes.hex)
    conv.register_structure_hook(bytes, _structure_resource_id)
    for enum_type in (RecordKind, BindingKind):
        conv.register_unstructure_hook(enum_type, _enum_name)
        conv.register_structure_hook(enum_type, _structure_enum)
    conv.register_unstructure_hook(RecordFlag, _unstructure_flags)
    conv.register_structure_hook(RecordFlag, _structure_flags)
    conv.register_structure_hook_func(_is_type(ContentMode), _structure_content_mode)
    # A record lists only the fields its kind uses (the rest are zero by the protocol).
    conv.register_unstructure_hook(
        Record, make_dict_unstructure_fn(Record, conv, _cattrs_omit_if_default=True)
    )
    # A participant's pair, start time and pid namespace where known (0: not recorded).
    conv.register_unstructure_hook(
        StateParticipant,
        make_dict_unstructure_fn(StateParticipant, conv, _cattrs_omit_if_default=True),
    )
    # Who fetched what (FETCH records) describes the running team, not the capture.
    conv.register_unstructure_hook(
        ParticipantTopology,
        make_dict_unstructure_fn(ParticipantTopology, conv, fetches=override(omit=True)),
    )
    # Innermost first: an outer class's hook captures its fields' hooks when made.
    _register_lists_only(conv, tuple[Access, ...])
    conv.register_structure_hook(Record, _fast_record_hook(conv.get_structure_hook(Record)))
    _register_lists_only(conv, tuple[Record, ...])
    conv.register_structure_hook(
        ParticipantTopology,
        make_dict_structure_fn(
            ParticipantTopology, conv, fetches=override(omit=True), _cattrs_forbid_extra_keys=True
        ),
    )
    for sequence in (
        tuple[Record, ...],
        tuple[ParticipantTopology, ...],
        tuple[StateParticipant, ...],
    ):
        _register_lists_only(conv, sequence)
    return conv


@functools.cache
def _converter() -> cattrs.Converter:
    # The file's own converter, made once: making one generates and compiles code
    # for every class in the state, which costs more than reading a small file.
    # Private, so no caller can register a hook on it.
    return make_converter()


def _register_lists_only(conv: cattrs.Converter, sequence: object) -> None:
    conv.register_structure_hook_func(
        _is_type(sequence), _lists_only(conv.get_structure_hook(sequence))
    )


# --- encoding and decoding ----------------------------------------------------------


def state_problems(state: CheckpointState) -> list[str]:
    """What makes ``state`` unfit to be written or trusted after reading (empty if fine)."""
    problems: list[str] = []
    if state.protocol_version not in READABLE_PROTOCOL_VERSIONS:
        problems.append(
            f"protocol_version {state.protocol_version}; this engine reads "
            f"{' and '.join(map(str, READABLE_PROTOCOL_VERSIONS))}"
        )
    if state.content_mode not in CONTENT_MODES:
        problems.append(f"content_mode {state.content_mode!r} is not one of {CONTENT_MODES}")
    try:
        created = datetime.fromisoformat(state.created_at)
    except ValueError:
        problems.append(f"created_at {state.created_at!r} is not an ISO 8601 time")
    else:
        offset = created.utcoffset()
        if offset is None or offset.total_seconds() != 0:
            problems.append(f"created_at {state.created_at!r} is not in UTC")
    problems.extend(_participant_problems("participants", state.participants))
    problems.extend(_participant_problems("topology", state.topology.participants))
    listed = {(p.participant, p.pid) for p in state.participants}
    in_topology = {(p.participant, p.pid) for p in state.topology.participants}
    if listed != in_topology:
        problems.append(
            "participants and topology disagree:"
            f" only in participants {sorted(listed - in_topology)},"
            f" only in topology {sorted(in_topology - listed)}"
        )
    for member in state.topology.participants:
        for n, record in enumerate(member.records):
            if _encodes(record):
                continue
            where = f"participant {member.participant} record {n} ({record.kind.name})"
            unfit = _out_of_range(record)
            if unfit:
                problems.extend(f"{where}: {text}" for text in unfit)
                continue
            try:
                record.encode()  # the codec's own rules (ids, creator, access count)
            except wire.WireError as exc:
                problems.append(f"{where}: {exc}")
    return problems


def _encodes(record: Record) -> bool:
    """Whether the codec encodes ``record``: then every integer fits its wire width too
    (the struct's widths are _RECORD_WIDTHS), and state_problems has nothing to say
    about it. Anything else is looked at field by field, to say what is wrong."""
    try:
        record.encode()
    except Exception:
        return False
    return True


def _bits(width: int, signed: bool) -> tuple[str, int, int]:
    if signed:
        return (f"i{width}", -(1 << (width - 1)), (1 << (width - 1)) - 1)
    return (f"u{width}", 0, (1 << width) - 1)


# The wire widths of the record's integer fields (shim_c/protocol.h), so that a value
# that cannot be encoded is named by field instead of by the struct module.
_RECORD_WIDTHS: Final = {
    **dict.fromkeys(
        ("address", "size", "offset", "member_offset", "op_flags", "handle_types", "object_flags"),
        _bits(64, False),
    ),
    **dict.fromkeys(("allocation_type", "location_type", "location_id", "device"), _bits(32, True)),
    "num_devices": _bits(32, False),
    "handle_count": _bits(32, False),
    "api_version": _bits(8, False),
}
_ACCESS_WIDTHS: Final = {
    "location_type": _bits(32, True),
    "location_id": _bits(32, True),
    "flags": _bits(64, False),
}


def _out_of_range(record: Record) -> list[str]:
    unfit: list[str] = []
    fields = [(name, getattr(record, name), width) for name, width in _RECORD_WIDTHS.items()]
    for n, access in enumerate(record.access):
        fields.extend(
            (f"access[{n}].{name}", getattr(access, name), width)
            for name, width in _ACCESS_WIDTHS.items()
        )
    for name, value, (type_name, low, high) in fields:
        if not low <= value <= high:
            unfit.append(f"{name} {value} does not fit {type_name}")
    return unfit


# --- the records' fast path ---------------------------------------------------------
#
# A state file holds thousands of records, and cattrs' generated hook costs a call
# per field, an exception frame per field and a keyword call per record. The fast
# path structures a record that is exactly well formed (known keys, kind present,
# every value of the type its hook demands) and returns what that hook would; for
# anything else it hands the same value to the generated hook, so every refusal
# and its message (and path) stays the generated hook's own.

_BAD: Final = object()
_RESOURCE_HEX: Final = re.compile(f"[0-9a-f]{{{2 * wire.ID_LEN}}}")
_RECORD_KINDS_BY_NAME: Final = dict(RecordKind.__members__)
_BINDING_KINDS_BY_NAME: Final = dict(BindingKind.__members__)
# Every list of distinct flag names, in any order, and the flags it stands for.
_FLAG_LISTS: Final = {
    names: functools.reduce(operator.or_, (RecordFlag[n] for n in names), RecordFlag(0))
    for size in range(len(RecordFlag.__members__) + 1)
    for names in itertools.permutations(RecordFlag.__members__, size)
}
_ACCESS_FIELDS: Final = frozenset(f.name for f in attrs.fields(Access))


def _fast_int(value: object) -> object:
    return value if type(value) is int else _BAD


def _fast_str(value: object) -> object:
    return value if isinstance(value, str) else _BAD


def _fast_resource_id(value: object) -> object:
    if isinstance(value, str) and _RESOURCE_HEX.fullmatch(value):
        return bytes.fromhex(value)
    return _BAD


def _fast_kind(value: object) -> object:
    return _RECORD_KINDS_BY_NAME.get(value, _BAD) if isinstance(value, str) else _BAD


def _fast_binding_kind(value: object) -> object:
    return _BINDING_KINDS_BY_NAME.get(value, _BAD) if isinstance(value, str) else _BAD


def _fast_flags(value: object) -> object:
    if type(value) is not list or not all(type(name) is str for name in value):
        return _BAD
    return _FLAG_LISTS.get(tuple(value), _BAD)


def _fast_access(value: object) -> object:
    if type(value) is not list:
        return _BAD
    access = []
    for item in value:
        if type(item) is not dict or item.keys() != _ACCESS_FIELDS:
            return _BAD
        location_type, location_id, flags = (
            item["location_type"],
            item["location_id"],
            item["flags"],
        )
        if type(location_type) is not int or type(location_id) is not int or type(flags) is not int:
            return _BAD
        access.append(Access(location_type, location_id, flags))
    return tuple(access)


_FAST_RECORD_FIELDS: Final[dict[str, Callable[[object], object]]] = {
    "kind": _fast_kind,
    "flags": _fast_flags,
    "id": _fast_resource_id,
    "member_id": _fast_resource_id,
    "creator": _fast_str,
    **dict.fromkeys(_RECORD_WIDTHS, _fast_int),
    "binding_kind": _fast_binding_kind,
    "access": _fast_access,
}


def _fast_record_hook(generated: Callable[[Any, Any], Record]) -> Callable[[Any, Any], Record]:
    fields = _FAST_RECORD_FIELDS

    def structure(value: Any, type_: Any) -> Record:
        if type(value) is dict and "kind" in value and value.keys() <= fields.keys():
            converted: dict[str, Any] = {}
            for key, item in value.items():
                result = fields[key](item)
                if result is _BAD:
                    break
                converted[key] = result
            else:
                return Record(**converted)
        return generated(value, type_)

    return structure


def _participant_problems(
    where: str, participants: Iterable[StateParticipant | ParticipantTopology]
) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    for p in participants:
        if not wire.is_participant_id(p.participant):
            problems.append(
                f"{where}: participant id {p.participant!r} is not 32 lowercase hex digits"
            )
        elif p.participant in seen:
            problems.append(f"{where}: participant {p.participant} is listed twice")
        seen.add(p.participant)
        if not 0 < p.pid <= _PID_MAX:
            problems.append(f"{where}: participant {p.participant} has pid {p.pid}, not a pid")
        if isinstance(p, StateParticipant):
            if not 0 <= p.observed_pid <= _PID_MAX:
                problems.append(f"{where}: participant {p.participant} has observed pid "
                                f"{p.observed_pid}, not a pid")  # fmt: skip
            if p.started < 0 or p.pid_namespace < 0:
                problems.append(f"{where}: participant {p.participant} has a negative start "
                                "time or pid namespace")  # fmt: skip
    return problems


_PARTICIPANT_KEYS: Final = frozenset({"participant", "pid", "observed_pid", "started",
                                       "pid_namespace"})  # fmt: skip


def _is_compact(value: object) -> bool:
    return isinstance(value, dict) and (
        "kind" in value or ({"participant", "pid"} <= value.keys() <= _PARTICIPANT_KEYS)
    )


# What json.dumps(value, allow_nan=False) builds on every call, built once.
_COMPACT_JSON: Final = json.JSONEncoder(allow_nan=False)


def _render(value: object, depth: int = 0) -> str:
    """Indented JSON, except that records and participant entries take one line each,
    so a reviewer (or diff) reads the topology one record per line."""
    inner, outer = "  " * (depth + 1), "  " * depth
    if isinstance(value, dict) and value and not _is_compact(value):
        items = [f"{inner}{json.dumps(k)}: {_render(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{outer}}}"
    if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
        if all(_is_compact(v) for v in value):  # records, participants: one line each
            encode = _COMPACT_JSON.encode
            items = [inner + encode(v) for v in value]
        else:
            items = [inner + _render(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + f"\n{outer}]"
    return _COMPACT_JSON.encode(value)


def encode_state(state: CheckpointState) -> bytes:
    """The file's bytes; ValueError if ``state`` is not something read_state would accept."""
    problems = state_problems(state)
    if problems:
        raise ValueError("; ".join(problems))
    body = _converter().unstructure(state)
    document = {"format": STATE_FORMAT, "version": STATE_VERSION, **body}
    data = (_render(document) + "\n").encode("ascii")
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"{len(data)} bytes exceed the {MAX_STATE_BYTES}-byte cap")
    return data


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _Invalid(f"key {key!r} appears twice in one object")
        result[key] = value
    return result


def _reject_constant(name: str) -> NoReturn:
    raise _Invalid(f"{name} is not a number JSON allows")


def _format_error(exc: BaseException, type_: type | None) -> str:
    if isinstance(exc, _Invalid):
        return str(exc)
    from cattrs.v import format_exception

    return format_exception(exc, type_)


# A state file nests a few levels (document, topology, participant, record, access);
# anything deeper is refused before it is structured (never a RecursionError).
MAX_STATE_NESTING: Final = 16
_too_deep = f"is corrupt: nested deeper than {MAX_STATE_NESTING} levels"


# What json.loads builds nests: exactly these types (the pairs hook returns a dict).
_CONTAINERS: Final = (dict, list)


def _nested_deeper(document: object, limit: int) -> bool:
    """Whether ``document`` (as json.loads gives it) nests lists and objects deeper than
    ``limit`` (no recursion).

    Level by level, keeping only the containers, by exact type: a file of 40 000
    records holds about 600 000 scalars, and a (node, depth) pair and an isinstance
    for each made the check 6-10x slower (0.56-1.33 s against 0.09-0.13 s, 2 CPUs)."""
    level: list[Any] = [document] if type(document) in _CONTAINERS else []
    depth = 1
    while level:
        if depth > limit:
            return True
        below: list[Any] = []
        keep = below.append
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) in _CONTAINERS:
                    keep(child)
        level, depth = below, depth + 1
    return False


def decode_state(data: bytes, path: Path) -> CheckpointState:
    """Parse and check a state file's bytes; StateFileError (naming ``path``) if unfit."""
    if not data.strip():
        raise StateFileError(path, "is empty (the capture that wrote it did not finish?)")
    if len(data) > MAX_STATE_BYTES:
        raise StateFileError(path, f"is over the {MAX_STATE_BYTES}-byte cap")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StateFileError(path, f"is corrupt: not UTF-8 text (byte {exc.start})") from exc
    try:
        document = json.loads(
            text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant
        )
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
            raise StateFileError(
                path,
                f"is truncated: the JSON ends early ({exc.msg}: line {exc.lineno},"
                f" column {exc.colno})",
            ) from exc
        raise StateFileError(
            path, f"is corrupt: not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno})"
        ) from exc
    except _Invalid as exc:
        raise StateFileError(path, f"is corrupt: {exc}") from exc
    except RecursionError:
        raise StateFileError(path, _too_deep) from None
    if _nested_deeper(document, MAX_STATE_NESTING):
        raise StateFileError(path, _too_deep)
    if not isinstance(document, dict):
        raise StateFileError(path, f"is not a JSON object but a {type(document).__name__}")
    if "format" not in document:
        raise StateFileError(path, 'has no "format" key: not a cuinterpose state file')
    if document["format"] != STATE_FORMAT:
        raise StateFileError(
            path,
            f"has format {document['format']!r}, not {STATE_FORMAT!r}: not a cuinterpose"
            " state file",
        )
    version = document.get("version")
    if type(version) is not int:
        raise StateFileError(path, f"has no integer version (got {version!r})")
    if version not in READABLE_STATE_VERSIONS:
        raise StateFileError(
            path,
            f"has version {version}; this cuinterpose reads versions "
            f"{' and '.join(map(str, READABLE_STATE_VERSIONS))} only",
        )
    if version == 1 and any(
        isinstance(p, dict) and p.keys() - {"participant", "pid"}
        for p in document.get("participants", ()) or ()
    ):
        raise StateFileError(path, "is malformed: version 1 participants have two keys")
    body = {k: v for k, v in document.items() if k not in ("format", "version")}
    import cattrs
    from cattrs.v import transform_error

    try:
        state = _converter().structure(body, CheckpointState)
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        details = transform_error(exc, path="$", format_exception=_format_error)
        raise StateFileError(path, "is malformed: " + "; ".join(details)) from exc
    problems = state_problems(state)
    if problems:
        raise StateFileError(path, "is inconsistent: " + "; ".join(problems))
    return state


# --- the file -----------------------------------------------------------------------


def write_state(directory: Path, state: CheckpointState, name: str = STATE_FILE_NAME) -> Path:
    """Write the state file into ``directory`` atomically and durably; returns its path.

    ``name`` is the state file's by default; the intent a capture records before its
    first destructive op is the same document under another name.

    A temporary file in the same directory is written and fsynced, renamed over the
    state file, and the directory fsynced so the rename survives a crash. On any
    failure the temporary file is removed and the old state file (if any) is intact.
    """
    directory = Path(directory)
    try:
        data = encode_state(state)
    except ValueError as exc:
        raise StateFileError(directory / name, f"not written: {exc}") from exc
    return write_atomically(directory, name, data)


def write_atomically(directory: Path, name: str, data: bytes) -> Path:
    """Write ``data`` as ``directory/name``: temporary file, fsync, rename, directory fsync."""
    target = directory / name
    try:
        fd, temp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise StateFileError(
            target, f"not written: cannot create a temporary file in {directory}: {exc}"
        ) from exc
    temp = Path(temp_name)
    try:
        with open(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException as exc:
        temp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise StateFileError(target, f"not written: {exc}") from exc
        raise
    try:
        fsync_directory(directory)
    except OSError as exc:
        raise StateFileError(
            target, f"written, but syncing {directory} failed (may not survive a crash): {exc}"
        ) from exc
    return target


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_state(directory: Path, name: str = STATE_FILE_NAME) -> CheckpointState:
    """Read and check the state file in ``directory``; StateFileError says what is wrong."""
    path = Path(directory) / name
    try:
        # Never through a link, and never blocking on a FIFO planted under the name.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise StateFileError(
            path, "is missing: no cuinterpose capture was completed into this directory"
        ) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateFileError(path, "is a symbolic link; refused") from exc
        raise StateFileError(path, f"cannot be opened: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError(path, "is not a regular file")
        if info.st_size > MAX_STATE_BYTES:
            raise StateFileError(
                path, f"is {info.st_size} bytes, over the {MAX_STATE_BYTES}-byte cap"
            )
        # Read one byte past the cap: a file that grew since fstat is refused too.
        with open(fd, "rb", closefd=False) as handle:
            data = handle.read(MAX_STATE_BYTES + 1)
    except OSError as exc:
        raise StateFileError(path, f"cannot be read: {exc}") from exc
    finally:
        os.close(fd)
    return decode_state(data, path)
