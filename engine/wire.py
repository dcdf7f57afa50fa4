"""The control protocol's codec: messages and records as frozen attrs classes.

``shim_c/protocol.h`` is the single source of truth; ``tests/engine/test_wire_pin.py``
compiles a program printing every size and offset there and compares them with
the layouts below. Encoding refuses values that do not fit; decoding refuses
anything that is not exactly a well-formed message, naming what is wrong.
"""

from __future__ import annotations

import enum
import re
import struct
from typing import Any, ClassVar, Final

import attrs

MAGIC: Final = 0x50495543
VERSION: Final = 2
HEADER_SIZE: Final = 128
RECORD_SIZE: Final = 288
PARTICIPANT_LEN: Final = 32
ID_LEN: Final = 16
AUTH_LEN: Final = 16
MESSAGE_MAX: Final = 1024
RECORDS_MAX: Final = 65536
ACCESS_MAX: Final = 8
SOCKET_PREFIX: Final = "cuinterpose-"
SOCKET_SUFFIX: Final = ".sock"
# The control directory's path, in bytes, at most (protocol.h says why).
CONTROL_DIR_MAX: Final = 60
# A STATUS request's stat_count asking for the path of the shim's libcuda.
ASK_DRIVER: Final = 1
# STATUS: which GPUs the shim's process uses (the reply's message, GpuLine per line).
ASK_DEVICES: Final = 2
# STATUS: both at once (the asks are bits): the driver's path on the message's first
# line, the devices report after it (protocol.h CUIP_ASK_ALL).
ASK_ALL: Final = ASK_DRIVER | ASK_DEVICES
# An EXPORT request's stat_count withdrawing a fetch whose open failed.
EXPORT_WITHDRAW: Final = 1

# The stored files of STORE_STAGED / FETCH_STAGED (protocol.h, specs/protocol.md): per
# process 1 to STORED_MAX_PARTS parts, each a header naming its index, the part count and
# the dump's identity; part 0's header followed by one entry per allocation, then each
# part's stripe sums (XXH64, uint64 each). The bytes are one stream (each allocation at
# the previous one's end rounded up to STORED_ALIGN) in STORED_STRIPE-byte stripes,
# stripe s in part s mod parts. STORE_STAGED and FETCH_STAGED name the dump in the
# request's resource_id.
STORED_MAGIC: Final = 0x47545343
STORED_VERSION: Final = 3
STORED_ALIGN: Final = 4096
STORED_STRIPE: Final = 8 << 20
STORED_MAX_PARTS: Final = 64
STORED_HEADER_STRUCT: Final = struct.Struct("<IIIHHQQ32s16sQ")
STORED_SUM_STRUCT: Final = struct.Struct("<Q")
STORED_ENTRY_STRUCT: Final = struct.Struct("<16sQQ")

HEADER_STRUCT: Final = struct.Struct("<IHHiI32s16s16sIIIHHQQQQ")
ACCESS_STRUCT: Final = struct.Struct("<iiQ")
RECORD_STRUCT: Final = struct.Struct("<HHI16s16s32sQQQQQQQiiiiIBBHII" + "iiQ" * ACCESS_MAX)

ZERO_PARTICIPANT: Final = b"\0" * PARTICIPANT_LEN
ZERO_ID: Final = b"\0" * ID_LEN
_HEX_DIGITS: Final = frozenset("0123456789abcdef")
_HEX_BYTES: Final = re.compile(rb"[0-9a-f]{32}")
_HEX_TEXT: Final = re.compile(r"[0-9a-f]{32}")


class Op(enum.IntEnum):
    HANDSHAKE = 1
    INSPECT = 2
    PREPARE_MULTICAST = 3
    SAVE_ALLOCATIONS = 4
    PREPARE_UNICAST = 5
    LOAD_ALLOCATIONS = 6
    RESTORE_UNICAST = 7
    RESTORE_MULTICAST_CREATORS = 8
    RESTORE_MULTICAST_IMPORTERS = 9
    RESTORE_MULTICAST_DEVICES = 10
    RESTORE_MULTICAST_BINDINGS = 11
    EXPORT = 12
    ROLLBACK_ALLOCATIONS = 13
    ROLLBACK_IMPORTS = 14
    RELEASE = 15  # ends the coordinator's lease; served in any phase
    STATUS = 16  # read-only, served while a phase op runs: see InFlight
    QUIESCE = 17  # closes the shim's gate until the process is quiet (specs/quiesce.md)
    STORE_STAGED = 18  # the staged copies into the file handed with the request
    FETCH_STAGED = 19  # and back from it (specs/criu.md)
    HOST_COPY = 20  # the kept host copy on, or given back (specs/shim.md)


# The ops whose request hands the shim open files (SCM_RIGHTS): always 1 to
# STORED_MAX_PARTS, which the decoded bytes cannot show (decode_request gives none).
FILE_OPS: Final = frozenset({Op.STORE_STAGED, Op.FETCH_STAGED})


class Phase(enum.IntEnum):
    ACTIVE = 1
    MULTICAST_DETACHED = 2
    ALLOCATIONS_SAVED = 3
    PREPARED = 4
    ALLOCATIONS_LOADED = 5
    UNICAST_RESTORED = 6
    MULTICAST_CREATED = 7
    MULTICAST_IMPORTED = 8
    MULTICAST_JOINED = 9
    ROLLBACK_LOADED = 10
    QUIESCED = 11
    FAILED = 15


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1
    WRONG_PARTICIPANT = 2
    WRONG_PHASE = 3
    CUDA_FAILED = 4
    REFUSED = 5
    UNAUTHORIZED = 6
    NOT_FOUND = 7
    INTERNAL = 8
    RETRY = 9  # transient (out of memory): nothing kept, the phase unchanged, send again
    # A QUIESCE round's "not quiet yet": ACTIVE with the gate still closed (specs/quiesce.md).
    PENDING = 10


class ResourceKind(enum.IntEnum):
    NONE = 0
    UNICAST = 1
    MULTICAST = 2


class RecordKind(enum.IntEnum):
    ALLOCATION = 1
    MAPPING = 2
    MC_OBJECT = 3
    MC_DEVICE = 4
    MC_BINDING = 5
    MC_MAPPING = 6
    RAW_IMPORT = 7
    UNSUPPORTED_EXPORTABLE = 8
    # A creator's note that a participant fetched one of its allocations: not part of
    # the topology (see Topology.fetches); member_id carries the fetcher's id as bytes.
    FETCH = 9
    # Sharing the shim does not own (op_flags: an Unowned), so it cannot rebuild it.
    UNOWNED_SHARING = 10
    # The kept host copy's figures (SNAPSHOT_SHIM_KEEP_HOST_COPY): in the replies of
    # SAVE/LOAD/ROLLBACK_ALLOCATIONS and STATUS, never in INSPECT's (see HostCopy).
    HOST_COPY = 11


class HashState(enum.IntEnum):
    """HOST_COPY's op_flags: how a SAVE chose what to copy (protocol.h, cuip_hash)."""

    NOT_SAVED = 0
    COMPARED = 1
    FIRST = 2
    UNAVAILABLE = 3


class Unowned(enum.IntEnum):
    """UNOWNED_SHARING's op_flags: the call that made the sharing (protocol.h)."""

    IPC_EXPORT = 1
    IPC_OPEN = 2
    POOL_EXPORT = 3
    POOL_IMPORT = 4


class ReplyFlag(enum.IntFlag):
    """The reply header's ``flags`` (zero in requests)."""

    # A QUIESCE refused because the process did not get quiet within its deadline:
    # nothing changed, the gate is open again, the capture may start over.
    NOT_QUIET = 1


class RecordFlag(enum.IntFlag):
    CREATOR = 1
    HANDLE_LIVE = 2
    CONTENT = 4


class BindingKind(enum.IntEnum):
    NONE = 0
    BIND_MEM = 1
    BIND_ADDR = 2


_OPS: Final = {int(o): o for o in Op}
_STATUSES: Final = {int(s): s for s in Status}
_PHASES: Final = {int(p): p for p in Phase}
_RECORD_KINDS: Final = {int(k): k for k in RecordKind}
_BINDING_KINDS: Final = {int(k): k for k in BindingKind}
_KNOWN_FLAGS: Final = int(RecordFlag.CREATOR | RecordFlag.HANDLE_LIVE | RecordFlag.CONTENT)
_KNOWN_REPLY_FLAGS: Final = int(ReplyFlag.NOT_QUIET)
_REPLY_FLAGS: Final = tuple(ReplyFlag(v) for v in range(_KNOWN_REPLY_FLAGS + 1))
_NO_FLAGS: Final = ReplyFlag(0)
_RECORD_FLAGS: Final = tuple(RecordFlag(v) for v in range(_KNOWN_FLAGS + 1))


class WireError(ValueError):
    """Bytes that are not a well-formed message, or values that cannot be encoded."""


class VersionMismatch(WireError):
    """A message of another protocol version: its ``version`` is the peer's."""

    def __init__(self, version: int) -> None:
        super().__init__(f"unsupported protocol version {version}, expected {VERSION}")
        self.version = version


def is_participant_id(value: str) -> bool:
    """32 lowercase hex digits: the only form a participant id takes."""
    return len(value) == PARTICIPANT_LEN and set(value) <= _HEX_DIGITS


def _participant_bytes(value: str, field: str) -> bytes:
    if type(value) is str and _HEX_TEXT.fullmatch(value):
        return value.encode("ascii")
    if value == "":
        return ZERO_PARTICIPANT
    if not is_participant_id(value):
        raise WireError(f"{field} {value!r} is not 32 lowercase hex digits")
    return value.encode("ascii")


def _participant_text(raw: bytes, field: str) -> str:
    if raw == ZERO_PARTICIPANT:
        return ""
    if _HEX_BYTES.fullmatch(raw):
        return raw.decode("ascii")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as exc:
        raise WireError(f"{field} is not ASCII: {raw!r}") from exc
    if not is_participant_id(text):
        raise WireError(f"{field} {text!r} is not 32 lowercase hex digits")
    return text


def _fixed(value: bytes, length: int, field: str) -> bytes:
    if len(value) != length:
        raise WireError(f"{field} must be {length} bytes, got {len(value)}")
    return value


def _record_flag(value: object) -> RecordFlag:
    # Record's converter: what RecordFlag(value) gives, without the enum machinery
    # when the value already is one (every decoded record's is).
    if type(value) is RecordFlag:
        return value
    return RecordFlag(value)  # type: ignore[arg-type]


@attrs.frozen
class Access:
    """One access descriptor: a location and the access flags granted to it."""

    location_type: int
    location_id: int
    flags: int


# The zeros that fill the unused access slots, by the number of slots in use.
_ACCESS_PADDING: Final = tuple((0,) * 3 * (ACCESS_MAX - n) for n in range(ACCESS_MAX + 1))


@attrs.frozen
class Record:
    """One topology record (288 bytes on the wire); unused fields stay zero."""

    kind: RecordKind
    flags: RecordFlag = attrs.field(default=RecordFlag(0), converter=_record_flag)
    id: bytes = ZERO_ID
    member_id: bytes = ZERO_ID
    creator: str = ""
    address: int = 0
    size: int = 0
    offset: int = 0
    member_offset: int = 0
    op_flags: int = 0
    handle_types: int = 0
    object_flags: int = 0
    allocation_type: int = 0
    location_type: int = 0
    location_id: int = 0
    device: int = 0
    num_devices: int = 0
    binding_kind: BindingKind = BindingKind.NONE
    api_version: int = 0
    handle_count: int = 0
    access: tuple[Access, ...] = ()
    pid: int = 0  # FETCH: the fetching process, as SO_PEERCRED showed it to the creator

    SIZE: ClassVar[int] = RECORD_SIZE

    @property
    def fetcher(self) -> str:
        """FETCH: the id of the participant that fetched (member_id's 16 bytes in hex)."""
        return self.member_id.hex() if self.kind is RecordKind.FETCH else ""

    def encode(self) -> bytes:
        if len(self.access) > ACCESS_MAX:
            raise WireError(
                f"record has {len(self.access)} access descriptors, at most {ACCESS_MAX}"
            )
        flat = [v for a in self.access for v in (a.location_type, a.location_id, a.flags)]
        try:
            return RECORD_STRUCT.pack(
                int(self.kind),
                int(self.flags),
                len(self.access),
                _fixed(self.id, ID_LEN, "record id"),
                _fixed(self.member_id, ID_LEN, "record member_id"),
                _participant_bytes(self.creator, "record creator"),
                self.address,
                self.size,
                self.offset,
                self.member_offset,
                self.op_flags,
                self.handle_types,
                self.object_flags,
                self.allocation_type,
                self.location_type,
                self.location_id,
                self.device,
                self.num_devices,
                int(self.binding_kind),
                self.api_version,
                0,
                self.handle_count,
                self.pid,
                *flat,
                *_ACCESS_PADDING[len(self.access)],
            )
        except struct.error as exc:
            raise WireError(f"record field out of range: {exc}") from exc

    @classmethod
    def decode(cls, raw: bytes) -> Record:
        if len(raw) != RECORD_SIZE:
            raise WireError(f"record must be {RECORD_SIZE} bytes, got {len(raw)}")
        return _record_from_fields(RECORD_STRUCT.unpack(raw), {}, {})


# The positions of RECORD_STRUCT's fields (see Record.encode for their order).
_R_KIND, _R_FLAGS, _R_ACCESS_COUNT, _R_CREATOR, _R_BINDING = 0, 1, 2, 5, 18
_R_RESERVED0, _R_PID, _R_ACCESS = 20, 22, 23


def _record_from_fields(
    fields: tuple[Any, ...],
    creators: dict[bytes, str],
    accesses: dict[tuple[int, ...], Access],
) -> Record:
    """One record from RECORD_STRUCT's unpacked fields, checked as the protocol demands.

    A reply can carry 65536 records: plain dict lookups instead of enum
    construction, Access objects only for the slots in use, and ``creators`` and
    ``accesses`` (caches the caller keeps for one block of records) so that a
    creator id is checked, and an access descriptor built, once per block.
    """
    kind = fields[_R_KIND]
    record_kind = _RECORD_KINDS.get(kind)
    if record_kind is None:
        raise WireError(f"unknown record kind {kind}")
    flags = fields[_R_FLAGS]
    if flags & ~_KNOWN_FLAGS:
        raise WireError(f"{record_kind.name} record has unknown flags {flags:#x}")
    access_count = fields[_R_ACCESS_COUNT]
    if access_count > ACCESS_MAX:
        raise WireError(f"{record_kind.name} record has access_count {access_count} > {ACCESS_MAX}")
    binding_kind = fields[_R_BINDING]
    binding = _BINDING_KINDS.get(binding_kind)
    if binding is None:
        raise WireError(f"{record_kind.name} record has unknown binding_kind {binding_kind}")
    if fields[_R_RESERVED0]:
        raise WireError(f"{record_kind.name} record has non-zero reserved fields")
    if fields[_R_PID] and record_kind is not RecordKind.FETCH:
        raise WireError(f"{record_kind.name} record has a pid (only FETCH records carry one)")
    used = _R_ACCESS + 3 * access_count
    if any(fields[used:]):
        raise WireError(f"{record_kind.name} record has non-zero unused access slots")
    access: tuple[Access, ...] = ()
    if access_count:
        slots = []
        for i in range(_R_ACCESS, used, 3):
            key = fields[i : i + 3]
            descriptor = accesses.get(key)
            if descriptor is None:
                descriptor = accesses[key] = Access(*key)
            slots.append(descriptor)
        access = tuple(slots)
    raw_creator = fields[_R_CREATOR]
    creator = creators.get(raw_creator)
    if creator is None:
        creator = _participant_text(raw_creator, f"{record_kind.name} record creator")
        creators[raw_creator] = creator
    # Positional, in field order (keywords cost a third more per record).
    return Record(
        record_kind,
        _RECORD_FLAGS[flags],
        fields[3],  # id
        fields[4],  # member_id
        creator,
        fields[6],  # address
        fields[7],  # size
        fields[8],  # offset
        fields[9],  # member_offset
        fields[10],  # op_flags
        fields[11],  # handle_types
        fields[12],  # object_flags
        fields[13],  # allocation_type
        fields[14],  # location_type
        fields[15],  # location_id
        fields[16],  # device
        fields[17],  # num_devices
        binding,
        fields[19],  # api_version
        fields[21],  # handle_count
        access,
        fields[_R_PID],
    )


def decode_records(block: bytes, count: int) -> tuple[Record, ...]:
    """``count`` records packed back to back in ``block``, decoded in one pass.

    Refuses exactly what :meth:`Record.decode` refuses, record by record, with the
    same messages; ``block`` must hold exactly ``count`` records.
    """
    if len(block) != count * RECORD_SIZE:
        raise WireError(f"records are {len(block)} bytes, header says {count} x {RECORD_SIZE}")
    creators: dict[bytes, str] = {}
    accesses: dict[tuple[int, ...], Access] = {}
    return tuple(
        _record_from_fields(fields, creators, accesses)
        for fields in RECORD_STRUCT.iter_unpack(block)
    )


@attrs.frozen
class Stats:
    """What SAVE/LOAD_ALLOCATIONS report: allocations and bytes moved, times in ns."""

    count: int = 0
    bytes: int = 0
    elapsed_ns: int = 0
    copy_ns: int = 0


# The stat fields whose meaning is the op's, by name (protocol.h's cuip_quiesce_*
# and cuip_status_* accessors; tests/engine/test_wire_pin.py pins both to the bytes):
# QUIESCE request: deadline_ns in elapsed_ns, round in count; QUIESCE reply: the
# threads held at the gate in count; STATUS request: what it asks in count; STATUS
# reply: InFlight's fields; EXPORT request: the size the importer was handed in bytes,
# WITHDRAW (its open failed after the fetch: forget the FETCH record) in count.


def quiesce_request_stats(deadline_ns: int, round_: bool) -> Stats:
    """A QUIESCE request's stat fields: its deadline and its round flag."""
    return Stats(count=int(round_), elapsed_ns=deadline_ns)


def export_request_stats(size: int, withdraw: bool) -> Stats:
    """An EXPORT request's stat fields: the size handed out, and the withdraw flag."""
    return Stats(count=EXPORT_WITHDRAW if withdraw else 0, bytes=size)


# A HOST_COPY request's stat_count: the kept host copy on, or every copy given back.
HOST_COPY_KEEP: Final = 1
HOST_COPY_GIVE_BACK: Final = 2


def host_copy_request_stats(keep: bool) -> Stats:
    """A HOST_COPY request's stat fields: keep (HOST_COPY_KEEP) or give back."""
    return Stats(count=HOST_COPY_KEEP if keep else HOST_COPY_GIVE_BACK)


def status_request_stats(ask_driver: bool, ask_devices: bool = False) -> Stats:
    """A STATUS request's stat fields: what it asks, as bits (ASK_DRIVER, ASK_DEVICES)."""
    return Stats(count=(ASK_DRIVER if ask_driver else 0) | (ASK_DEVICES if ask_devices else 0))


def quiesce_deadline_ns(stats: Stats) -> int:
    """A QUIESCE request's deadline (ns; 0: the shim's own)."""
    return stats.elapsed_ns


def quiesce_round(stats: Stats) -> int:
    """A QUIESCE request's round flag (1: a round)."""
    return stats.count


def quiesce_held(stats: Stats) -> int:
    """A QUIESCE reply's threads held at the gate."""
    return stats.count


def status_ask(stats: Stats) -> int:
    """What a STATUS request asks: ASK_DRIVER and ASK_DEVICES as bits (0: neither)."""
    return stats.count


@attrs.frozen
class InFlight:
    """A STATUS reply's stat fields, named: the phase op in flight and its bytes.

    ``op`` is None when no phase op runs; ``bytes_total`` is 0 for an op that
    copies nothing (protocol.h: cuip_status_op, cuip_status_bytes_done,
    cuip_status_bytes_total, cuip_status_elapsed_ns).
    """

    op: Op | None
    bytes_done: int
    bytes_total: int
    elapsed_ns: int

    @classmethod
    def from_stats(cls, stats: Stats) -> InFlight:
        op = _OPS.get(stats.count) if stats.count else None
        if stats.count and op is None:
            raise WireError(f"STATUS reply names unknown op {stats.count} in flight")
        return cls(op, stats.bytes, stats.copy_ns, stats.elapsed_ns)

    def stats(self) -> Stats:
        """The stat fields a shim's STATUS reply carries for this."""
        op = int(self.op) if self.op is not None else 0
        return Stats(op, self.bytes_done, self.elapsed_ns, self.bytes_total)


_NO_STATS: Final = Stats()


@attrs.frozen
class Header:
    """The fixed 128-byte header, decoded; ``message`` and records follow it."""

    op: int
    status: int = 0
    count: int = 0
    participant: str = ""
    resource_id: bytes = ZERO_ID
    authorization: bytes = ZERO_ID
    resource_kind: int = 0
    message_length: int = 0
    pid: int = 0
    phase: int = 0
    stats: Stats = attrs.field(factory=Stats)
    flags: int = 0  # replies: ReplyFlag bits
    # Only a test double speaking another version encodes anything but VERSION;
    # decoding refuses any other (VersionMismatch).
    version: int = VERSION

    def encode(self) -> bytes:
        try:
            return HEADER_STRUCT.pack(
                MAGIC,
                self.version,
                self.op,
                self.status,
                self.count,
                _participant_bytes(self.participant, "participant"),
                _fixed(self.resource_id, ID_LEN, "resource_id"),
                _fixed(self.authorization, AUTH_LEN, "authorization"),
                self.resource_kind,
                self.message_length,
                self.pid,
                self.phase,
                self.flags,
                self.stats.count,
                self.stats.bytes,
                self.stats.elapsed_ns,
                self.stats.copy_ns,
            )
        except struct.error as exc:
            raise WireError(f"header field out of range: {exc}") from exc

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        if len(raw) != HEADER_SIZE:
            raise WireError(f"header must be {HEADER_SIZE} bytes, got {len(raw)}")
        (
            magic, version, op, status, count, participant, resource_id, authorization,
            resource_kind, message_length, pid, phase, flags, *stats,
        ) = HEADER_STRUCT.unpack(raw)  # fmt: skip
        if magic != MAGIC:
            raise WireError(f"bad magic {magic:#010x}, expected {MAGIC:#010x}")
        if version != VERSION:
            raise VersionMismatch(version)
        if flags & ~_KNOWN_REPLY_FLAGS:
            raise WireError(f"header has unknown flags {flags:#x}")
        if message_length > MESSAGE_MAX:
            raise WireError(f"message_length {message_length} exceeds {MESSAGE_MAX}")
        if count > RECORDS_MAX:
            raise WireError(f"record count {count} exceeds {RECORDS_MAX}")
        # Positional, in field order: every reply goes through here.
        return cls(
            op,
            status,
            count,
            _participant_text(participant, "participant"),
            resource_id,
            authorization,
            resource_kind,
            message_length,
            pid,
            phase,
            Stats(*stats),
            flags,
        )


@attrs.frozen
class Request:
    """What the coordinator (or a peer shim, for EXPORT) sends.

    ``authorization`` is EXPORT's capability authorization, and in every other
    request the coordinator's lease token (all zero: no lease; see
    specs/recovery.md). ``fetcher`` is EXPORT's requesting participant, sent as
    the request's text.
    """

    op: Op
    participant: str = ""
    # EXPORT: the allocation asked for. STORE_STAGED and FETCH_STAGED: the dump's identity
    # (16 random bytes: the images' seal), written into every part, and expected in them.
    resource_id: bytes = ZERO_ID
    authorization: bytes = ZERO_ID
    resource_kind: ResourceKind = ResourceKind.NONE
    fetcher: str = ""
    # QUIESCE only: the longest the coordinator lets it take, ns (0: the shim's own),
    # and whether it is a round: a shim not quiet by then answers PENDING and keeps its
    # gate closed instead of refusing (carried in stat_count).
    deadline_ns: int = 0
    round: bool = False
    # STATUS only: ask which driver the shim loaded (the reply's message is its path
    # instead of the stored failure reason; carried in stat_count as ASK_DRIVER).
    ask_driver: bool = False
    # STATUS only: ask which GPUs the shim's process uses (carried as ASK_DEVICES). Both
    # asked: one message, the driver's path on its first line (ASK_ALL).
    ask_devices: bool = False
    # LOAD_ALLOCATIONS only: the native restore's GPU mapping, "GPU-old=GPU-new,..." (sent
    # as the request's text; the shim checks every GPU it used is the one named now).
    gpu_map: str = ""
    # EXPORT only: the size the importer was handed (the creator serves nothing else),
    # and whether this withdraws a fetch whose open failed (carried in stat_bytes and
    # stat_count).
    export_size: int = 0
    withdraw: bool = False
    # HOST_COPY only: give every kept host copy back and turn the mode off; a HOST_COPY
    # without it turns the mode on (carried in stat_count: HOST_COPY_GIVE_BACK, _KEEP).
    give_back: bool = False
    # STORE_STAGED and FETCH_STAGED only (and always, 1 to STORED_MAX_PARTS): the open
    # files the request hands the shim, part k the k-th, sent with the header as
    # SCM_RIGHTS; not part of the encoded bytes.
    fds: tuple[int, ...] = attrs.field(default=(), eq=False)

    @property
    def lease(self) -> bytes:
        """The lease token a non-EXPORT request carries (all zero: none)."""
        return ZERO_ID if self.op is Op.EXPORT else self.authorization

    def encode(self) -> bytes:
        exporting = self.op is Op.EXPORT
        if not exporting and (
            (self.resource_id != ZERO_ID and self.op not in FILE_OPS)
            or self.resource_kind is not ResourceKind.NONE
            or self.fetcher
            or self.export_size
            or self.withdraw
        ):
            raise WireError(f"{self.op.name} request carries EXPORT-only fields")
        if self.op in (Op.HANDSHAKE, Op.RELEASE) and self.participant:
            raise WireError(f"{self.op.name} request must not name a participant")
        if self.op is Op.RELEASE and self.authorization == ZERO_ID:
            raise WireError("RELEASE request carries no lease token")
        if (self.deadline_ns or self.round) and self.op is not Op.QUIESCE:
            raise WireError(f"{self.op.name} request carries a deadline (QUIESCE only)")
        if (self.ask_driver or self.ask_devices) and self.op is not Op.STATUS:
            raise WireError(f"{self.op.name} request asks what STATUS only answers")
        if self.give_back and self.op is not Op.HOST_COPY:
            raise WireError(f"{self.op.name} request gives host copies back (HOST_COPY only)")
        if self.gpu_map and self.op is not Op.LOAD_ALLOCATIONS:
            raise WireError(f"{self.op.name} request carries a GPU mapping (LOAD_ALLOCATIONS only)")
        if self.fds and self.op not in FILE_OPS:
            raise WireError(
                f"{self.op.name} request carries a file descriptor (STORE_STAGED and "
                "FETCH_STAGED only)"
            )
        if len(self.fds) > STORED_MAX_PARTS:
            raise WireError(
                f"{self.op.name} request carries {len(self.fds)} file descriptors, more than "
                f"{STORED_MAX_PARTS}"
            )
        if not 0 <= self.deadline_ns < 2**64:
            raise WireError(f"deadline_ns {self.deadline_ns} does not fit 64 bits")
        text = _participant_bytes(self.fetcher, "fetcher") if exporting else b""
        if self.gpu_map:
            text = _gpu_map_bytes(self.gpu_map)
        if self.op is Op.QUIESCE:
            stats = quiesce_request_stats(self.deadline_ns, self.round)
        elif self.op is Op.STATUS:
            stats = status_request_stats(self.ask_driver, self.ask_devices)
        elif exporting:
            stats = export_request_stats(self.export_size, self.withdraw)
        elif self.op is Op.HOST_COPY:
            stats = host_copy_request_stats(not self.give_back)
        else:
            stats = _NO_STATS
        # What Header(op, participant, ids, kind, stats).encode() packs, without
        # building the Header: the reply-only fields are zero.
        try:
            return (
                HEADER_STRUCT.pack(
                    MAGIC,
                    VERSION,
                    int(self.op),
                    0,
                    0,
                    _participant_bytes(self.participant, "participant"),
                    _fixed(self.resource_id, ID_LEN, "resource_id"),
                    _fixed(self.authorization, AUTH_LEN, "authorization"),
                    int(self.resource_kind),
                    len(text),
                    0,
                    0,
                    0,
                    stats.count,
                    stats.bytes,
                    stats.elapsed_ns,
                    stats.copy_ns,
                )
                + text
            )
        except struct.error as exc:
            raise WireError(f"header field out of range: {exc}") from exc


@attrs.frozen
class Reply:
    """What a shim answers: status, its identity and phase, text, stats, records."""

    op: Op
    status: Status
    participant: str
    pid: int
    phase: Phase
    message: str = ""
    stats: Stats = attrs.field(factory=Stats)
    records: tuple[Record, ...] = ()
    flags: ReplyFlag = _NO_FLAGS

    @property
    def not_quiet(self) -> bool:
        """A QUIESCE refused because the process did not get quiet in time (nothing
        changed, the gate is open again: the capture may start over)."""
        return ReplyFlag.NOT_QUIET in self.flags

    def encode(self) -> bytes:
        text = self.message.encode("utf-8")
        if len(text) > MESSAGE_MAX:
            raise WireError(f"message of {len(text)} bytes exceeds {MESSAGE_MAX}")
        if len(self.records) > RECORDS_MAX:
            raise WireError(f"{len(self.records)} records exceed {RECORDS_MAX}")
        header = Header(
            op=int(self.op),
            status=int(self.status),
            count=len(self.records),
            participant=self.participant,
            message_length=len(text),
            pid=self.pid,
            phase=int(self.phase),
            stats=self.stats,
            flags=int(self.flags),
        )
        return b"".join([header.encode(), text, *(r.encode() for r in self.records)])

    @classmethod
    def from_parts(cls, header: Header, message: bytes, records: bytes) -> Reply:
        """Build a reply from a decoded header and the bytes that followed it."""
        op = _OPS.get(header.op)
        if op is None:
            raise WireError(f"reply names unknown op {header.op}")
        status = _STATUSES.get(header.status)
        if status is None:
            raise WireError(f"reply has unknown status {header.status}")
        phase = _PHASES.get(header.phase)
        if phase is None:
            raise WireError(f"reply has unknown phase {header.phase}")
        if len(message) != header.message_length:
            raise WireError(f"message is {len(message)} bytes, header says {header.message_length}")
        if len(records) != header.count * RECORD_SIZE:
            raise WireError(
                f"records are {len(records)} bytes, header says {header.count} x {RECORD_SIZE}"
            )
        if not header.participant:
            raise WireError("reply carries no participant id")
        try:
            text = message.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireError("reply message is not UTF-8") from exc
        return cls(
            op,
            status,
            header.participant,
            header.pid,
            phase,
            text,
            header.stats,
            decode_records(records, header.count),
            _REPLY_FLAGS[header.flags],
        )

    @classmethod
    def decode(cls, raw: bytes) -> Reply:
        """Decode one whole reply (header, text, records) held in memory."""
        if len(raw) < HEADER_SIZE:
            raise WireError(f"reply of {len(raw)} bytes is shorter than the header")
        header = Header.decode(raw[:HEADER_SIZE])
        text_end = HEADER_SIZE + header.message_length
        return cls.from_parts(header, raw[HEADER_SIZE:text_end], raw[text_end:])


def decode_request(raw: bytes) -> tuple[Request, Header]:
    """Decode a request as a shim must: anything non-zero where zero is required is
    refused. ``raw`` is the header, then for EXPORT its text (the fetcher's id)."""
    header = Header.decode(raw[:HEADER_SIZE])
    try:
        op = Op(header.op)
    except ValueError as exc:
        raise WireError(f"unknown op {header.op}") from exc
    text_length = PARTICIPANT_LEN if op is Op.EXPORT else 0
    if op is Op.LOAD_ALLOCATIONS and header.message_length <= MESSAGE_MAX:
        text_length = header.message_length
    if (
        header.status
        or header.count
        or header.message_length != text_length
        or header.pid
        or header.phase
        or header.flags
    ):
        raise WireError(f"{op.name} request has reply-only fields set")
    stats = header.stats
    deadline = quiesce_deadline_ns(stats) if op is Op.QUIESCE else 0
    round_flag = quiesce_round(stats) if op is Op.QUIESCE else 0
    ask = status_ask(stats) if op is Op.STATUS else 0
    withdraw = stats.count if op is Op.EXPORT else 0
    if round_flag > 1 or ask > ASK_ALL or withdraw > EXPORT_WITHDRAW:
        raise WireError(f"{op.name} request has stats set")
    if op is Op.QUIESCE:
        allowed = quiesce_request_stats(deadline, bool(round_flag))
    elif op is Op.STATUS:
        allowed = status_request_stats(bool(ask & ASK_DRIVER), bool(ask & ASK_DEVICES))
    elif op is Op.EXPORT:
        allowed = export_request_stats(stats.bytes, bool(withdraw))
    elif op is Op.HOST_COPY:
        allowed = host_copy_request_stats(stats.count == HOST_COPY_KEEP)
    else:
        allowed = _NO_STATS
    if stats != allowed:
        raise WireError(f"{op.name} request has stats set")
    text = raw[HEADER_SIZE:]
    if len(text) != text_length:
        raise WireError(f"{op.name} request has {len(text)} bytes of text, expected {text_length}")
    try:
        kind = ResourceKind(header.resource_kind)
    except ValueError as exc:
        raise WireError(f"unknown resource_kind {header.resource_kind}") from exc
    request = Request(
        op=op,
        participant=header.participant,
        resource_id=header.resource_id,
        authorization=header.authorization,
        resource_kind=kind,
        fetcher=_participant_text(text, "fetcher") if text and op is Op.EXPORT else "",
        deadline_ns=deadline,
        round=bool(round_flag),
        ask_driver=bool(ask & ASK_DRIVER),
        ask_devices=bool(ask & ASK_DEVICES),
        gpu_map=_gpu_map_text(text) if op is Op.LOAD_ALLOCATIONS else "",
        export_size=stats.bytes if op is Op.EXPORT else 0,
        withdraw=bool(withdraw),
        give_back=op is Op.HOST_COPY and stats.count == HOST_COPY_GIVE_BACK,
    )
    request.encode()  # the same field rules as for sending
    return request, header


def _gpu_map_bytes(text: str) -> bytes:
    raw = text.encode("ascii", errors="strict") if text.isascii() else b""
    if not raw or len(raw) > MESSAGE_MAX:
        raise WireError(f"GPU mapping must be 1..{MESSAGE_MAX} ASCII bytes, got {text!r}")
    return raw


def _gpu_map_text(raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError as exc:
        raise WireError("LOAD_ALLOCATIONS request's GPU mapping is not ASCII") from exc


def socket_name(namespace_pid: int) -> str:
    """The control socket's file name for a shim whose getpid() is ``namespace_pid``."""
    return f"{SOCKET_PREFIX}{namespace_pid}{SOCKET_SUFFIX}"


@attrs.frozen
class HostCopy:
    """A HOST_COPY record, by name (protocol.h, ``cuip_host_copy_*``): the host memory the
    kept copies hold (pinned) and how many there are, their hash tables' bytes, and in a
    SAVE/LOAD reply the bytes the op copied, those it left unchanged, and how it chose."""

    bytes: int
    count: int
    overhead: int
    copied: int
    unchanged: int
    hash: HashState

    @classmethod
    def of(cls, record: Record) -> HostCopy:
        if record.kind is not RecordKind.HOST_COPY:
            raise WireError(f"a {record.kind.name} record is no HOST_COPY record")
        try:
            state = HashState(record.op_flags)
        except ValueError as exc:
            raise WireError(f"HOST_COPY record has unknown hash state {record.op_flags}") from exc
        return cls(
            record.size, record.address, record.member_offset, record.offset,
            record.object_flags, state,
        )  # fmt: skip

    def record(self) -> Record:
        return Record(
            kind=RecordKind.HOST_COPY, size=self.bytes, address=self.count,
            member_offset=self.overhead, offset=self.copied, object_flags=self.unchanged,
            op_flags=int(self.hash),
        )  # fmt: skip

    @classmethod
    def in_reply(cls, records: tuple[Record, ...]) -> HostCopy | None:
        """The reply's HOST_COPY record, None when it carries none; two is a WireError."""
        found = [r for r in records if r.kind is RecordKind.HOST_COPY]
        if len(found) > 1:
            raise WireError(f"a reply carries {len(found)} HOST_COPY records")
        return cls.of(found[0]) if found else None
