"""Pins engine/wire.py to shim_c/protocol.h, the single source of truth.

A C program, generated from the header's own declarations and compiled with
``cc``, prints the size and offset of every field of every struct, the value
of every constant, and the bytes of a header and a record filled with
distinctive values, the op table (``CUIP_OPS``: every op's number, the phases it is
served in, whether it tears something down) and the phase machine
(``CUIP_PHASE_OPS``, and the way back: ``CUIP_ROLLBACK_OPS``). The Python side must
agree on all of it: struct formats (derived from the C field types), field order,
sizes, enums, limits, the bytes that encoding produces and decoding accepts, and the
tables (``phases/ops.py``: ``OPS``, ``PHASE_OPS``, ``ROLLBACK_OPS``).
A change on either side, a new constant or field included, fails here.
"""

from __future__ import annotations

import enum
import re
import shutil
import struct
import subprocess
from collections.abc import Mapping
from pathlib import Path

import attrs
import pytest
from cuinterpose.engine import wire
from cuinterpose.engine.wire import (
    Access,
    BindingKind,
    Header,
    Op,
    Phase,
    Record,
    RecordFlag,
    RecordKind,
    Request,
    ResourceKind,
    Stats,
    Status,
    decode_request,
)
from cuinterpose.phases.ops import EVERY_PHASE, OPS, PHASE_OPS, ROLLBACK_OPS

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_H = ROOT / "shim_c" / "protocol.h"

# C scalar types and the struct codes wire.py must use for them.
SCALAR_CODES = {
    "uint8_t": "B",
    "uint16_t": "H",
    "uint32_t": "I",
    "uint64_t": "Q",
    "int32_t": "i",
}

# What Python has no constant for is pinned to the contract's text (specs/protocol.md).
CONTRACT_ONLY: Mapping[str, int | str] = {
    "CUIP_CONTROL_DIR_DEFAULT": "/snapshot-control",
    "CUIP_CONTROL_DIR_ENV": "SNAPSHOT_CONTROL_DIR",
    "CUIP_PARTICIPANT_ENV": "SNAPSHOT_PARTICIPANT_ID",
    "CUIP_CAP_MAGIC": 0x43495543,
    "CUIP_CAP_VERSION": 1,
    "CUIP_CAP_ENDPOINT_LEN": 40,
    "CUIP_IPC_MAGIC": 0x48495543,
    "CUIP_IPC_AUTH_LEN": 12,
    "CUIP_PARTICIPANT_BYTES": 16,
}

# The capability never crosses to the coordinator, so Python has no codec for
# it; its layout (specs/protocol.md, "Capability") is pinned here: (field, offset, size).
CAPABILITY_LAYOUT = [
    ("magic", 0, 4),
    ("version", 4, 2),
    ("resource_kind", 6, 2),
    ("creator", 8, 32),
    ("resource_id", 40, 16),
    ("authorization", 56, 16),
    ("endpoint", 72, 40),
    ("size", 112, 8),
    ("handle_types", 120, 4),
    ("flags", 124, 2),
    ("num_devices", 126, 2),
]

# The shim's legacy IPC handle travels between shims only, inside CUipcMemHandle's
# 64 bytes (specs/protocol.md, "Legacy IPC handle").
IPC_HANDLE_LAYOUT = [
    ("magic", 0, 4),
    ("creator_pid", 4, 4),
    ("creator", 8, 16),
    ("resource_id", 24, 16),
    ("authorization", 40, 12),
    ("offset", 52, 4),
    ("size", 56, 8),
]


@attrs.frozen
class CField:
    name: str
    ctype: str
    length: str | None  # array length as written (a number or a macro)


def python_constants() -> dict[str, int | str]:
    """Every constant protocol.h must define, with the value Python uses for it."""
    constants: dict[str, int | str] = {
        "CUIP_MAGIC": wire.MAGIC,
        "CUIP_VERSION": wire.VERSION,
        "CUIP_PARTICIPANT_LEN": wire.PARTICIPANT_LEN,
        "CUIP_ID_LEN": wire.ID_LEN,
        "CUIP_AUTH_LEN": wire.AUTH_LEN,
        "CUIP_MESSAGE_MAX": wire.MESSAGE_MAX,
        "CUIP_RECORDS_MAX": wire.RECORDS_MAX,
        "CUIP_ACCESS_MAX": wire.ACCESS_MAX,
        "CUIP_SOCKET_PREFIX": wire.SOCKET_PREFIX,
        "CUIP_SOCKET_SUFFIX": wire.SOCKET_SUFFIX,
        "CUIP_CONTROL_DIR_MAX": wire.CONTROL_DIR_MAX,
        "CUIP_OP_MAX": max(Op),
        "CUIP_ASK_DRIVER": wire.ASK_DRIVER,
        "CUIP_ASK_DEVICES": wire.ASK_DEVICES,
        "CUIP_ASK_ALL": wire.ASK_ALL,
        "CUIP_EXPORT_WITHDRAW": wire.EXPORT_WITHDRAW,
        "CUIP_STORED_MAGIC": wire.STORED_MAGIC,
        "CUIP_STORED_VERSION": wire.STORED_VERSION,
        "CUIP_STORED_ALIGN": wire.STORED_ALIGN,
        "CUIP_STORED_STRIPE": wire.STORED_STRIPE,
        "CUIP_STORED_MAX_PARTS": wire.STORED_MAX_PARTS,
        "CUIP_EVERY_PHASE": phase_set(EVERY_PHASE),
        "CUIP_HOST_COPY_KEEP": wire.HOST_COPY_KEEP,
        "CUIP_HOST_COPY_GIVE_BACK": wire.HOST_COPY_GIVE_BACK,
        **CONTRACT_ONLY,
    }
    prefixes: list[tuple[str, type[enum.Enum]]] = [
        ("CUIP_OP_", Op),
        ("CUIP_PHASE_", Phase),
        ("CUIP_STATUS_", Status),
        ("CUIP_RESOURCE_", ResourceKind),
        ("CUIP_RECORD_", RecordKind),
        ("CUIP_FLAG_", RecordFlag),
        ("CUIP_REPLY_", wire.ReplyFlag),
        ("CUIP_UNOWNED_", wire.Unowned),
        ("CUIP_HASH_", wire.HashState),
        ("CUIP_", BindingKind),  # CUIP_BIND_MEM, CUIP_BIND_ADDR
    ]
    for prefix, enum_type in prefixes:
        for member in enum_type:
            # NONE is Python's name for "field unused" (zero), not a C constant.
            if member.name != "NONE":
                constants[prefix + str(member.name)] = int(member.value)
    return constants


def phase_set(names: tuple[str, ...]) -> int:
    """A set of phases as protocol.h writes it: bit p for phase p."""
    return sum(1 << Phase[name] for name in set(names))


def parse_header(text: str) -> tuple[list[str], list[str], dict[str, list[CField]]]:
    """Integer constant names, string constant names and struct fields, as declared."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    ints: list[str] = []
    strings: list[str] = []
    for name, value in re.findall(r"^#define\s+(CUIP_\w+)\s+(.+?)\s*$", text, flags=re.M):
        (strings if value.startswith('"') else ints).append(name)
    for body in re.findall(r"enum\s+\w+\s*\{(.*?)\};", text, flags=re.S):
        ints.extend(re.findall(r"(CUIP_\w+)\s*=", body))
    # The ops' enum comes from the op table: one constant per row.
    table = re.search(r"^#define CUIP_OPS\(X\)((?:.*\\\n)*.*)$", text, flags=re.M)
    assert table, "protocol.h declares no op table (CUIP_OPS)"
    ints.extend(f"CUIP_OP_{name}" for name in re.findall(r"\bX\((\w+),", table[1]))
    structs: dict[str, list[CField]] = {}
    for name, body in re.findall(r"struct\s+(cuip_\w+)\s*\{(.*?)\};", text, flags=re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            match = re.fullmatch(r"((?:struct\s+)?\w+)\s+(\w+)(?:\[(\w+)\])?", decl)
            assert match, f"cannot parse the declaration {decl!r} in struct {name}"
            fields.append(CField(match[2], match[1], match[3]))
        structs[name] = fields
    return ints, strings, structs


def c_bytes(value: bytes) -> str:
    return "{" + ", ".join(str(b) for b in value) + "}"


def c_fill(var: str, values: Mapping[str, int | bytes]) -> str:
    lines = []
    for field, value in values.items():
        if isinstance(value, bytes):
            lines.append(f"memcpy({var}.{field}, (const unsigned char[]){c_bytes(value)}, ")
            lines[-1] += f"{len(value)});"
        else:
            lines.append(f"{var}.{field} = {value};")
    return "\n    ".join(lines)


# Distinctive values: every field different, every byte of multi-byte fields
# different, signed fields negative, so a swapped, resized or mis-signed field
# shows in the bytes.
HEADER_VALUES: dict[str, int | bytes] = {
    "magic": wire.MAGIC,
    "version": wire.VERSION,
    "op": 0x0A0B,
    "status": -0x01020304,
    "count": 0xFEDC,  # decoding refuses more than RECORDS_MAX
    "participant": b"0123456789abcdef" + b"fedcba9876543210",
    "resource_id": bytes(range(0x20, 0x30)),
    "authorization": bytes(range(0x40, 0x50)),
    "resource_kind": 0x21222324,
    "message_length": 0x0302,  # decoding refuses more than MESSAGE_MAX
    "pid": 0x41424344,
    "phase": 0x5152,
    "flags": 1,  # decoding refuses unknown flags
    "stat_count": 0x6162636465666768,
    "stat_bytes": 0x7172737475767778,
    "stat_elapsed_ns": 0x0102030405060708,
    "stat_copy_ns": 0x1112131415161718,
}

PIN_HEADER = Header(
    op=0x0A0B,
    status=-0x01020304,
    count=0xFEDC,
    participant="0123456789abcdeffedcba9876543210",
    resource_id=bytes(range(0x20, 0x30)),
    authorization=bytes(range(0x40, 0x50)),
    resource_kind=0x21222324,
    message_length=0x0302,
    pid=0x41424344,
    phase=0x5152,
    stats=Stats(0x6162636465666768, 0x7172737475767778, 0x0102030405060708, 0x1112131415161718),
    flags=1,
)

ACCESS_VALUES = [(-0x0101, 0x0202, 0x0303030303030303), (0x0404, -0x0505, 0x0606), (7, 8, 9)]

RECORD_VALUES: dict[str, int | bytes] = {
    "kind": int(RecordKind.MC_BINDING),
    "flags": 7,
    "access_count": len(ACCESS_VALUES),
    "id": bytes(range(1, 17)),
    "member_id": bytes(range(0x81, 0x91)),
    "creator": b"00112233445566778899aabbccddeeff",
    "address": 0x1011121314151617,
    "size": 0x2021222324252627,
    "offset": 0x3031323334353637,
    "member_offset": 0x4041424344454647,
    "op_flags": 0x5051525354555657,
    "handle_types": 0x6061626364656667,
    "object_flags": 0x7071727374757677,
    "allocation_type": -0x01020304,
    "location_type": -0x05060708,
    "location_id": 0x090A0B0C,
    "device": -0x0D0E0F10,
    "num_devices": 0x11223344,
    "binding_kind": int(BindingKind.BIND_ADDR),
    "api_version": 0xA5,
    "reserved0": 0,
    "handle_count": 0x55667788,
    "pid": 0,  # FETCH records only (test_wire checks a FETCH record's pid at offset 156)
}

PIN_RECORD = Record(
    kind=RecordKind.MC_BINDING,
    flags=RecordFlag(7),
    id=bytes(range(1, 17)),
    member_id=bytes(range(0x81, 0x91)),
    creator="00112233445566778899aabbccddeeff",
    address=0x1011121314151617,
    size=0x2021222324252627,
    offset=0x3031323334353637,
    member_offset=0x4041424344454647,
    op_flags=0x5051525354555657,
    handle_types=0x6061626364656667,
    object_flags=0x7071727374757677,
    allocation_type=-0x01020304,
    location_type=-0x05060708,
    location_id=0x090A0B0C,
    device=-0x0D0E0F10,
    num_devices=0x11223344,
    binding_kind=BindingKind.BIND_ADDR,
    api_version=0xA5,
    handle_count=0x55667788,
    access=tuple(Access(*a) for a in ACCESS_VALUES),
)


def c_program(ints: list[str], strings: list[str], structs: dict[str, list[CField]]) -> str:
    lines = []
    for name in ints:
        lines.append(f'printf("int {name} %lld\\n", (long long)({name}));')
    for name in strings:
        lines.append(f'printf("str {name} %s\\n", {name});')
    for struct_name, fields in structs.items():
        lines.append(f'printf("sizeof {struct_name} %zu\\n", sizeof(struct {struct_name}));')
        for f in fields:
            lines.append(
                f'printf("field {struct_name} {f.name} %zu %zu\\n", '
                f"offsetof(struct {struct_name}, {f.name}), "
                f"sizeof(((struct {struct_name} *)0)->{f.name}));"
            )
    # The op table as the X-macro declares it, with the enum value each name stands
    # for (an unknown name does not compile).
    lines.append(
        "#define PIN_OP(name, number, served_in, tears_down) "
        'printf("op %s %d %d %u %d\\n", #name, (int)CUIP_OP_##name, (int)(number), '
        "(unsigned)(served_in), (int)(tears_down));"
    )
    lines.append("CUIP_OPS(PIN_OP)")
    # The phase machine, and the way back.
    lines.append(
        "#define PIN_PHASE_OP(op, reaches, transfers) "
        'printf("%s %s %d %s %d %d\\n", pin_table, #op, (int)CUIP_OP_##op, '
        "#reaches, (int)CUIP_PHASE_##reaches, (int)(transfers));"
    )
    lines.append('{ const char *pin_table = "phase_op"; CUIP_PHASE_OPS(PIN_PHASE_OP) }')
    lines.append('{ const char *pin_table = "rollback_op"; CUIP_ROLLBACK_OPS(PIN_PHASE_OP) }')
    # The shim's own accessors of the op table.
    lines.append(
        "for (unsigned op = 0; op <= CUIP_OP_MAX + 1; op++) {"
        ' printf("op_name %u %s", op, cuip_op_name(op));'
        " for (unsigned p = 0; p < 32; p++)"
        '  if (cuip_op_served_in(op, p)) printf(" %u", p);'
        ' printf("\\n"); }'
    )
    # The stat fields' per-op names: each setter on a header of zeros (dumped), and
    # each getter of what the setters wrote.
    lines.append(PER_OP_PROGRAM)
    access_fill = "\n    ".join(
        f"r.access[{i}].location_type = {t}; r.access[{i}].location_id = {loc}; "
        f"r.access[{i}].flags = {flags}ull;"
        for i, (t, loc, flags) in enumerate(ACCESS_VALUES)
    )
    body = "\n    ".join(lines)
    return f"""
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include "protocol.h"

static void dump(const char *what, const void *p, size_t n) {{
    const unsigned char *b = p;
    printf("bytes %s ", what);
    for (size_t i = 0; i < n; i++) printf("%02x", b[i]);
    printf("\\n");
}}

int main(void) {{
    {body}
    struct cuip_header h;
    memset(&h, 0, sizeof h);
    {c_fill("h", HEADER_VALUES)}
    dump("header", &h, sizeof h);
    struct cuip_record r;
    memset(&r, 0, sizeof r);
    {c_fill("r", RECORD_VALUES)}
    {access_fill}
    dump("record", &r, sizeof r);
    return 0;
}}
"""


# Distinctive values for the per-op names of the stat fields.
DEADLINE_NS = 0x0102030405060708
IN_FLIGHT = wire.InFlight(Op.LOAD_ALLOCATIONS, 0x1112131415161718, 0x2122232425262728, 0x313233)
HELD = 0x0A0B
HOST = wire.HostCopy(
    0x0102030405060708, 0x11, 0x2122, 0x3132333435, 0x4142434445, wire.HashState.COMPARED
)
EXPORT_SIZE = 0x0C0D0E0F10111213

PER_OP_PROGRAM = f"""
{{
    struct cuip_header q;
    memset(&q, 0, sizeof q);
    q.magic = CUIP_MAGIC; q.version = CUIP_VERSION; q.op = CUIP_OP_QUIESCE;
    cuip_set_quiesce_deadline_ns(&q, {DEADLINE_NS}ull);
    cuip_set_quiesce_round(&q, 1);
    dump("quiesce_request", &q, sizeof q);
    printf("read quiesce_request %llu %llu\\n", (unsigned long long)cuip_quiesce_deadline_ns(&q),
           (unsigned long long)cuip_quiesce_round(&q));
    memset(&q, 0, sizeof q);
    q.magic = CUIP_MAGIC; q.version = CUIP_VERSION; q.op = CUIP_OP_STATUS;
    cuip_set_status_ask(&q, CUIP_ASK_DRIVER);
    dump("status_request", &q, sizeof q);
    printf("read status_request %llu\\n", (unsigned long long)cuip_status_ask(&q));
    memset(&q, 0, sizeof q);
    q.magic = CUIP_MAGIC; q.version = CUIP_VERSION; q.op = CUIP_OP_STATUS;
    cuip_set_status_ask(&q, CUIP_ASK_ALL);
    dump("status_request_all", &q, sizeof q);
    printf("read status_request_all %llu\\n", (unsigned long long)cuip_status_ask(&q));
    memset(&q, 0, sizeof q);
    cuip_set_export_size(&q, {EXPORT_SIZE}ull);
    cuip_set_export_withdraw(&q, CUIP_EXPORT_WITHDRAW);
    dump("export_request", &q, sizeof q);
    printf("read export_request %llu %llu\\n", (unsigned long long)cuip_export_size(&q),
           (unsigned long long)cuip_export_withdraw(&q));
    memset(&q, 0, sizeof q);
    cuip_set_status_in_flight(&q, CUIP_OP_{IN_FLIGHT.op.name}, {IN_FLIGHT.bytes_done}ull,
                              {IN_FLIGHT.bytes_total}ull, {IN_FLIGHT.elapsed_ns}ull);
    dump("status_reply", &q, sizeof q);
    printf("read status_reply %llu %llu %llu %llu\\n", (unsigned long long)cuip_status_op(&q),
           (unsigned long long)cuip_status_bytes_done(&q),
           (unsigned long long)cuip_status_bytes_total(&q),
           (unsigned long long)cuip_status_elapsed_ns(&q));
    memset(&q, 0, sizeof q);
    cuip_set_quiesce_held(&q, {HELD}ull);
    dump("quiesce_reply", &q, sizeof q);
    printf("read quiesce_reply %llu\\n", (unsigned long long)cuip_quiesce_held(&q));
    struct cuip_record hr;
    memset(&hr, 0, sizeof hr);
    cuip_set_host_copy(&hr, {HOST.bytes}ull, {HOST.count}ull, {HOST.overhead}ull,
                       {HOST.copied}ull, {HOST.unchanged}ull, CUIP_HASH_{HOST.hash.name});
    dump("host_copy", &hr, sizeof hr);
    printf("read host_copy %llu %llu %llu %llu %llu %llu\\n",
           (unsigned long long)cuip_host_copy_bytes(&hr),
           (unsigned long long)cuip_host_copy_count(&hr),
           (unsigned long long)cuip_host_copy_overhead(&hr),
           (unsigned long long)cuip_host_copy_copied(&hr),
           (unsigned long long)cuip_host_copy_unchanged(&hr),
           (unsigned long long)cuip_host_copy_hash(&hr));
}}
"""


@attrs.frozen
class CLayout:
    ints: dict[str, int]
    strings: dict[str, str]
    sizes: dict[str, int]
    fields: dict[str, list[tuple[str, int, int]]]  # struct -> [(field, offset, size)]
    declared: dict[str, list[CField]]
    dumps: dict[str, bytes]
    # CUIP_OPS in order: (name, its enum value, its number, served-in set, tears_down)
    ops: list[tuple[str, int, int, int, int]]
    # CUIP_PHASE_OPS and CUIP_ROLLBACK_OPS in order: (op, its value, reaches, its
    # value, transfers)
    phase_ops: list[tuple[str, int, str, int, int]]
    rollback_ops: list[tuple[str, int, str, int, int]]
    # cuip_op_name and cuip_op_served_in for every number 0 .. CUIP_OP_MAX + 1
    accessors: dict[int, tuple[str, frozenset[int]]]
    # What the per-op getters read, by dump name.
    reads: dict[str, tuple[int, ...]]


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> CLayout:
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.fail("no C compiler (cc): the wire pin cannot be checked, and must not be skipped")
    ints, strings, structs = parse_header(PROTOCOL_H.read_text())
    work = tmp_path_factory.mktemp("wire_pin")
    source = work / "pin.c"
    source.write_text(c_program(ints, strings, structs))
    binary = work / "pin"
    compiled = subprocess.run(
        [compiler, "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", str(PROTOCOL_H.parent),
         "-o", str(binary), str(source)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if compiled.returncode != 0:
        # The program uses protocol.h's own names: a renamed or removed field,
        # or a failing _Static_assert, is a contract change.
        pytest.fail(f"the pin program does not compile against protocol.h:\n{compiled.stderr}")
    out = subprocess.run(
        [str(binary)], check=True, capture_output=True, text=True, timeout=10
    ).stdout
    layout = CLayout({}, {}, {}, {name: [] for name in structs}, structs, {}, [], [], [], {}, {})
    for line in out.splitlines():
        tag, rest = line.split(" ", 1)
        if tag == "int":
            name, value = rest.split(" ")
            layout.ints[name] = int(value)
        elif tag == "str":
            name, text = rest.split(" ", 1)
            layout.strings[name] = text
        elif tag == "sizeof":
            name, size = rest.split(" ")
            layout.sizes[name] = int(size)
        elif tag == "field":
            struct_name, field, offset, size = rest.split(" ")
            layout.fields[struct_name].append((field, int(offset), int(size)))
        elif tag == "bytes":
            what, hexdump = rest.split(" ")
            layout.dumps[what] = bytes.fromhex(hexdump)
        elif tag == "op":
            name, value, number, served, tears_down = rest.split(" ")
            layout.ops.append((name, int(value), int(number), int(served), int(tears_down)))
        elif tag in ("phase_op", "rollback_op"):
            op, op_value, reaches, reaches_value, transfers = rest.split(" ")
            table = layout.phase_ops if tag == "phase_op" else layout.rollback_ops
            table.append((op, int(op_value), reaches, int(reaches_value), int(transfers)))
        elif tag == "read":
            what, *values = rest.split(" ")
            layout.reads[what] = tuple(int(v) for v in values)
        elif tag == "op_name":
            number, name, *phases = rest.split(" ")
            layout.accessors[int(number)] = (name, frozenset(int(p) for p in phases))
    return layout


def expected_format(layout: CLayout, struct_name: str) -> str:
    """The struct module format the C declaration of ``struct_name`` calls for."""
    codes = []
    for f in layout.declared[struct_name]:
        length = None if f.length is None else layout.ints.get(f.length) or int(f.length)
        if f.ctype.startswith("struct "):
            inner = expected_format(layout, f.ctype.split()[1]).lstrip("<")
            codes.append(inner * (length or 1))
        elif length is not None and f.ctype in ("char", "uint8_t"):
            codes.append(f"{length}s")
        else:
            assert f.ctype in SCALAR_CODES, f"{struct_name}.{f.name}: unknown C type {f.ctype}"
            codes.append(SCALAR_CODES[f.ctype] * (length or 1))
    return "<" + "".join(codes)


def packed_layout(fmt: str, names: list[str], counts: list[int]) -> list[tuple[str, int, int]]:
    """(field, offset, size) of consecutive groups of a packed struct format."""
    items = re.findall(r"(\d*)([a-zA-Z])", fmt.lstrip("<"))
    codes = [
        f"{n}{c}" if c == "s" else c
        for n, c in items
        for _ in range(1 if c == "s" else int(n or 1))
    ]
    result, offset, index = [], 0, 0
    for name, count in zip(names, counts, strict=True):
        size = sum(struct.calcsize("<" + c) for c in codes[index : index + count])
        result.append((name, offset, size))
        offset += size
        index += count
    assert index == len(codes), f"{fmt} has {len(codes) - index} items beyond the C fields"
    return result


def struct_items(layout: CLayout, struct_name: str) -> list[int]:
    """How many struct-module items each C field of ``struct_name`` packs to."""
    counts = []
    for f in layout.declared[struct_name]:
        fmt = expected_format(layout, f.ctype.split()[1]) if f.ctype.startswith("struct ") else ""
        length = None if f.length is None else layout.ints.get(f.length) or int(f.length)
        if fmt:
            counts.append(len(fmt) - 1 if length is None else (len(fmt) - 1) * length)
        elif length is not None and f.ctype in ("char", "uint8_t"):
            counts.append(1)
        else:
            counts.append(length or 1)
    return counts


@pytest.mark.parametrize(
    ("struct_name", "python_struct"),
    [
        ("cuip_header", wire.HEADER_STRUCT),
        ("cuip_access", wire.ACCESS_STRUCT),
        ("cuip_record", wire.RECORD_STRUCT),
        ("cuip_stored_header", wire.STORED_HEADER_STRUCT),
        ("cuip_stored_entry", wire.STORED_ENTRY_STRUCT),
    ],
)
def test_struct_formats_follow_the_c_declarations(
    c_layout: CLayout, struct_name: str, python_struct: struct.Struct
) -> None:
    assert python_struct.format == expected_format(c_layout, struct_name)
    assert python_struct.size == c_layout.sizes[struct_name]


@pytest.mark.parametrize(
    ("struct_name", "python_struct"),
    [
        ("cuip_header", wire.HEADER_STRUCT),
        ("cuip_access", wire.ACCESS_STRUCT),
        ("cuip_record", wire.RECORD_STRUCT),
        ("cuip_stored_header", wire.STORED_HEADER_STRUCT),
        ("cuip_stored_entry", wire.STORED_ENTRY_STRUCT),
    ],
)
def test_every_field_offset_and_size_matches(
    c_layout: CLayout, struct_name: str, python_struct: struct.Struct
) -> None:
    names = [f.name for f in c_layout.declared[struct_name]]
    python = packed_layout(python_struct.format, names, struct_items(c_layout, struct_name))
    assert python == c_layout.fields[struct_name]


def test_sizes_are_the_documented_ones(c_layout: CLayout) -> None:
    assert c_layout.sizes == {
        "cuip_header": wire.HEADER_SIZE,
        "cuip_access": wire.ACCESS_STRUCT.size,
        "cuip_record": wire.RECORD_SIZE,
        "cuip_capability": 128,
        "cuip_ipc_handle": 64,
        "cuip_stored_header": wire.STORED_HEADER_STRUCT.size,
        "cuip_stored_entry": wire.STORED_ENTRY_STRUCT.size,
    }
    assert (wire.STORED_HEADER_STRUCT.size, wire.STORED_ENTRY_STRUCT.size) == (88, 32)
    assert Record.SIZE == wire.RECORD_SIZE == 288
    assert wire.HEADER_SIZE == 128


def test_capability_layout(c_layout: CLayout) -> None:
    assert c_layout.fields["cuip_capability"] == CAPABILITY_LAYOUT


def test_ipc_handle_layout(c_layout: CLayout) -> None:
    assert c_layout.fields["cuip_ipc_handle"] == IPC_HANDLE_LAYOUT


def test_every_constant_matches(c_layout: CLayout) -> None:
    c_values: dict[str, int | str] = {**c_layout.ints, **c_layout.strings}
    python = python_constants()
    assert sorted(set(c_values) - set(python)) == [], "constants in protocol.h unknown to Python"
    assert sorted(set(python) - set(c_values)) == [], "constants Python has that protocol.h lacks"
    assert {k: c_values[k] for k in sorted(python)} == {k: python[k] for k in sorted(python)}


def test_socket_name_uses_the_c_prefix_and_suffix(c_layout: CLayout) -> None:
    prefix = c_layout.strings["CUIP_SOCKET_PREFIX"]
    suffix = c_layout.strings["CUIP_SOCKET_SUFFIX"]
    assert wire.socket_name(4242) == f"{prefix}4242{suffix}"


def test_header_bytes_match_c(c_layout: CLayout) -> None:
    c_header = c_layout.dumps["header"]
    assert PIN_HEADER.encode() == c_header
    assert Header.decode(c_header) == PIN_HEADER


def test_record_bytes_match_c(c_layout: CLayout) -> None:
    c_record = c_layout.dumps["record"]
    assert PIN_RECORD.encode() == c_record
    assert Record.decode(c_record) == PIN_RECORD


def test_pin_values_cover_every_c_field(c_layout: CLayout) -> None:
    # A field added to the C struct but not to the pin values would go unchecked.
    header_fields = [f.name for f in c_layout.declared["cuip_header"]]
    record_fields = [f.name for f in c_layout.declared["cuip_record"]]
    assert list(HEADER_VALUES) == header_fields
    assert [*RECORD_VALUES, "access"] == record_fields


def test_the_op_table_matches_the_engine_table(c_layout: CLayout) -> None:
    # One op table: the shim's CUIP_OPS and the engine's OPS, the same ops in the same
    # order, each with the same number, phases and tearing down; numbered 1 up.
    c_table = [
        (name, number, served, bool(tears_down))
        for name, _, number, served, tears_down in c_layout.ops
    ]
    python_table = [(o.name, o.number, phase_set(o.served_in), o.tears_down) for o in OPS]
    assert c_table == python_table
    assert [number for _, _, number, _, _ in c_layout.ops] == list(range(1, len(OPS) + 1))
    for name, value, number, _, tears_down in c_layout.ops:
        assert Op[name] == value == number
        assert tears_down in (0, 1)
    assert c_layout.ints["CUIP_OP_MAX"] == len(OPS)


def test_the_shims_op_accessors_read_the_table(c_layout: CLayout) -> None:
    # cuip_op_name and cuip_op_served_in, which the shim's control server and
    # EXPORT server use, say what the table says, and nothing for other numbers.
    expected = {o.number: (o.name, frozenset(int(Phase[p]) for p in o.served_in)) for o in OPS}
    for number in (0, len(OPS) + 1):
        expected[number] = ("?", frozenset())
    assert c_layout.accessors == expected


def test_phase_ops_match_the_engine_table(c_layout: CLayout) -> None:
    # One phase machine: the shim's CUIP_PHASE_OPS and the engine's PHASE_OPS, the
    # same ops in the same order, each reaching the same phase with the same
    # statistics; and the way back, CUIP_ROLLBACK_OPS and ROLLBACK_OPS.
    for c_rows, python_rows in (
        (c_layout.phase_ops, PHASE_OPS),
        (c_layout.rollback_ops, ROLLBACK_OPS),
    ):
        assert c_rows, "a phase table printed nothing"
        c_table = [(op, reaches, transfers) for op, _, reaches, _, transfers in c_rows]
        assert c_table == [(p.op, p.reaches, int(p.transfers)) for p in python_rows]
        for op, op_value, reaches, reaches_value, transfers in c_rows:
            assert Op[op] == op_value
            assert Phase[reaches] == reaches_value
            assert transfers in (0, 1)
    # No op is both a forward op and a rollback op.
    forward = {op for op, *_ in c_layout.phase_ops}
    assert forward.isdisjoint(op for op, *_ in c_layout.rollback_ops)


def _stat_fields(raw: bytes) -> Stats:
    return Stats(*struct.unpack_from("<QQQQ", raw, 96))


def test_the_per_op_stat_names_match_the_shims(c_layout: CLayout) -> None:
    # A QUIESCE request's deadline and round, a STATUS request's ask, a STATUS reply's
    # op in flight and bytes, a QUIESCE reply's threads held: the C accessors and the
    # Python codec put each in the same field, and read back what was put there.
    dumps, reads = c_layout.dumps, c_layout.reads
    quiesce = Request(Op.QUIESCE, deadline_ns=DEADLINE_NS, round=True)
    assert quiesce.encode() == dumps["quiesce_request"]
    assert decode_request(dumps["quiesce_request"])[0] == quiesce
    assert reads["quiesce_request"] == (DEADLINE_NS, 1)
    status = Request(Op.STATUS, ask_driver=True)
    assert status.encode() == dumps["status_request"]
    assert decode_request(dumps["status_request"])[0] == status
    assert reads["status_request"] == (wire.ASK_DRIVER,)
    both = Request(Op.STATUS, ask_driver=True, ask_devices=True)
    assert both.encode() == dumps["status_request_all"]
    assert decode_request(dumps["status_request_all"])[0] == both
    assert reads["status_request_all"] == (wire.ASK_ALL,)
    exporting = dumps["export_request"]
    assert _stat_fields(exporting) == wire.export_request_stats(EXPORT_SIZE, True)
    assert exporting[:96] == bytes(96)  # the setters touch the stat fields only
    assert reads["export_request"] == (EXPORT_SIZE, wire.EXPORT_WITHDRAW)
    in_flight = dumps["status_reply"]
    assert in_flight[:96] == bytes(96)  # the setter touches the stat fields only
    assert wire.InFlight.from_stats(_stat_fields(in_flight)) == IN_FLIGHT
    assert _stat_fields(in_flight) == IN_FLIGHT.stats()
    assert reads["status_reply"] == (
        int(Op.LOAD_ALLOCATIONS),
        IN_FLIGHT.bytes_done,
        IN_FLIGHT.bytes_total,
        IN_FLIGHT.elapsed_ns,
    )
    held = dumps["quiesce_reply"]
    assert held[:96] == bytes(96) and wire.quiesce_held(_stat_fields(held)) == HELD
    assert reads["quiesce_reply"] == (HELD,)
    # A HOST_COPY record: the C setter and HostCopy put each figure in the same field.
    kept = dumps["host_copy"]
    assert kept == HOST.record().encode()
    assert wire.HostCopy.of(wire.Record.decode(kept)) == HOST
    assert reads["host_copy"] == (
        HOST.bytes, HOST.count, HOST.overhead, HOST.copied, HOST.unchanged, int(HOST.hash)
    )


def test_a_header_of_another_version_is_refused_by_number(c_layout: CLayout) -> None:
    # The version is the header's second field in every version: a coordinator reads
    # it before anything else of a reply, and names it (client.ProtocolMismatch).
    assert ("version", 4, 2) in c_layout.fields["cuip_header"]
    older = bytearray(c_layout.dumps["header"])
    struct.pack_into("<H", older, 4, wire.VERSION - 1)
    with pytest.raises(wire.VersionMismatch) as caught:
        Header.decode(bytes(older))
    assert caught.value.version == wire.VERSION - 1
