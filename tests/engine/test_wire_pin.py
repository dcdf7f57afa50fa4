"""Pins engine/wire.py to shim_c/protocol.h, the single source of truth.

A C program, generated from the header's own declarations and compiled with
``cc``, prints the size and offset of every field of every struct, the value
of every constant, and the bytes of a header and a record filled with
distinctive values, and the phase machine (``CUIP_PHASE_OPS``, and the way back:
``CUIP_ROLLBACK_OPS``, ``CUIP_ROLLBACK_FROM``). The Python side must agree on all
of it: struct formats (derived from the C field types), field order, sizes, enums,
limits, the bytes that encoding produces and decoding accepts, and the phase
tables (``phases/ops.py``: ``PHASE_OPS``, ``ROLLBACK_OPS``, ``ROLLBACK_FROM``).
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
    ResourceKind,
    Stats,
    Status,
)
from cuinterpose.phases.ops import PHASE_OPS, ROLLBACK_FROM, ROLLBACK_OPS

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
        **CONTRACT_ONLY,
    }
    prefixes: list[tuple[str, type[enum.Enum]]] = [
        ("CUIP_OP_", Op),
        ("CUIP_PHASE_", Phase),
        ("CUIP_STATUS_", Status),
        ("CUIP_RESOURCE_", ResourceKind),
        ("CUIP_RECORD_", RecordKind),
        ("CUIP_FLAG_", RecordFlag),
        ("CUIP_UNOWNED_", wire.Unowned),
        ("CUIP_", BindingKind),  # CUIP_BIND_MEM, CUIP_BIND_ADDR
    ]
    for prefix, enum_type in prefixes:
        for member in enum_type:
            # NONE is Python's name for "field unused" (zero), not a C constant.
            if member.name != "NONE":
                constants[prefix + str(member.name)] = int(member.value)
    return constants


def parse_header(text: str) -> tuple[list[str], list[str], dict[str, list[CField]]]:
    """Integer constant names, string constant names and struct fields, as declared."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    ints: list[str] = []
    strings: list[str] = []
    for name, value in re.findall(r"^#define\s+(CUIP_\w+)\s+(.+?)\s*$", text, flags=re.M):
        (strings if value.startswith('"') else ints).append(name)
    for body in re.findall(r"enum\s+\w+\s*\{(.*?)\};", text, flags=re.S):
        ints.extend(re.findall(r"(CUIP_\w+)\s*=", body))
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
    "reserved": 0,
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
    # The phase machine as the X-macro declares it, with the enum values its
    # names stand for (an unknown name does not compile).
    lines.append(
        "#define PIN_PHASE_OP(op, needs, reaches, transfers) "
        'printf("phase_op %s %d %s %d %s %d %d\\n", #op, (int)CUIP_OP_##op, '
        "#needs, (int)CUIP_PHASE_##needs, #reaches, (int)CUIP_PHASE_##reaches, (int)(transfers));"
    )
    lines.append("CUIP_PHASE_OPS(PIN_PHASE_OP)")
    # The rollback ops: their `needs` is a list macro, printed phase by phase.
    lines.append('#define PIN_PHASE(p) printf(" %s %d", #p, (int)CUIP_PHASE_##p);')
    lines.append(
        "#define PIN_ROLLBACK_OP(op, needs, reaches, transfers) "
        'printf("rollback_op %s %d %s %d %d", #op, (int)CUIP_OP_##op, '
        "#reaches, (int)CUIP_PHASE_##reaches, (int)(transfers)); "
        'needs(PIN_PHASE) printf("\\n");'
    )
    lines.append("CUIP_ROLLBACK_OPS(PIN_ROLLBACK_OP)")
    lines.append('printf("rollback_from"); CUIP_ROLLBACK_FROM(PIN_PHASE) printf("\\n");')
    lines.append('printf("quiesce_from"); CUIP_QUIESCE_FROM(PIN_PHASE) printf("\\n");')
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


@attrs.frozen
class CLayout:
    ints: dict[str, int]
    strings: dict[str, str]
    sizes: dict[str, int]
    fields: dict[str, list[tuple[str, int, int]]]  # struct -> [(field, offset, size)]
    declared: dict[str, list[CField]]
    dumps: dict[str, bytes]
    # CUIP_PHASE_OPS in order: (op, its value, needs, its value, reaches, its value, transfers)
    phase_ops: list[tuple[str, int, str, int, str, int, int]]
    # CUIP_ROLLBACK_OPS in order: (op, its value, reaches, its value, transfers,
    # ((need, its value), ...))
    rollback_ops: list[tuple[str, int, str, int, int, tuple[tuple[str, int], ...]]]
    rollback_from: list[tuple[str, int]]  # CUIP_ROLLBACK_FROM: (phase, its value)
    quiesce_from: list[tuple[str, int]]  # CUIP_QUIESCE_FROM: (phase, its value)


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
    layout = CLayout({}, {}, {}, {name: [] for name in structs}, structs, {}, [], [], [], [])
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
        elif tag == "phase_op":
            op, op_value, needs, needs_value, reaches, reaches_value, transfers = rest.split(" ")
            layout.phase_ops.append(
                (op, int(op_value), needs, int(needs_value), reaches, int(reaches_value),
                 int(transfers))
            )  # fmt: skip
        elif tag == "rollback_op":
            op, op_value, reaches, reaches_value, transfers, *needs = rest.split(" ")
            layout.rollback_ops.append(
                (op, int(op_value), reaches, int(reaches_value), int(transfers),
                 phase_list(needs))
            )  # fmt: skip
        elif tag == "rollback_from":
            layout.rollback_from.extend(phase_list(rest.split(" ")))
        elif tag == "quiesce_from":
            layout.quiesce_from.extend(phase_list(rest.split(" ")))
    return layout


def phase_list(words: list[str]) -> tuple[tuple[str, int], ...]:
    """``NAME VALUE NAME VALUE ...`` as ((NAME, VALUE), ...)."""
    words = [w for w in words if w]
    return tuple((name, int(value)) for name, value in zip(words[::2], words[1::2], strict=True))


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
    }
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


def test_phase_ops_match_the_engine_table(c_layout: CLayout) -> None:
    # One phase machine: the shim's CUIP_PHASE_OPS and the engine's PHASE_OPS,
    # the same ops in the same order, each with the same phases and statistics.
    c_table = [
        (op, needs, reaches, transfers)
        for op, _, needs, _, reaches, _, transfers in c_layout.phase_ops
    ]
    # The X-macro names the first phase an op is served in; QUIESCE's whole list
    # is CUIP_QUIESCE_FROM (an advance in QUIESCED), every other op has one.
    python_table = [(p.op, p.needs[0], p.reaches, int(p.transfers)) for p in PHASE_OPS]
    assert c_table == python_table
    served = {p.op: p.needs for p in PHASE_OPS}
    assert [name for name, _ in c_layout.quiesce_from] == list(served.pop("QUIESCE"))
    assert all(len(needs) == 1 for needs in served.values())
    for name, value in c_layout.quiesce_from:
        assert Phase[name] == value


def test_phase_ops_name_wire_members(c_layout: CLayout) -> None:
    # The X-macro's names are the CUIP_OP_/CUIP_PHASE_ suffixes; their values are
    # the wire's, and `transfers` is a flag, not a count.
    assert c_layout.phase_ops, "CUIP_PHASE_OPS printed nothing"
    for op, op_value, needs, needs_value, reaches, reaches_value, transfers in c_layout.phase_ops:
        assert Op[op] == op_value
        assert Phase[needs] == needs_value
        assert Phase[reaches] == reaches_value
        assert transfers in (0, 1)


def test_rollback_ops_match_the_engine_table(c_layout: CLayout) -> None:
    # The way back: the shim's CUIP_ROLLBACK_OPS and the engine's ROLLBACK_OPS, the
    # same ops in the same order, each served in the same phases (in enum order),
    # reaching the same phase, with the same statistics.
    c_table = [
        (op, tuple(name for name, _ in needs), reaches, transfers)
        for op, _, reaches, _, transfers, needs in c_layout.rollback_ops
    ]
    python_table = [(p.op, p.needs, p.reaches, int(p.transfers)) for p in ROLLBACK_OPS]
    assert c_table == python_table
    assert [name for name, _ in c_layout.rollback_from] == list(ROLLBACK_FROM)
    assert c_layout.rollback_ops[0][0] == "ROLLBACK_ALLOCATIONS"
    assert c_layout.rollback_ops[0][5] == tuple(c_layout.rollback_from)


def test_rollback_ops_name_wire_members(c_layout: CLayout) -> None:
    assert c_layout.rollback_ops, "CUIP_ROLLBACK_OPS printed nothing"
    assert c_layout.rollback_from, "CUIP_ROLLBACK_FROM printed nothing"
    for op, op_value, reaches, reaches_value, transfers, needs in c_layout.rollback_ops:
        assert Op[op] == op_value
        assert Phase[reaches] == reaches_value
        assert transfers in (0, 1)
        assert needs, f"{op} is served in no phase"
        for name, value in needs:
            assert Phase[name] == value
        values = [value for _, value in needs]
        assert values == sorted(set(values)), f"{op}: phases repeated or not in enum order"
    for name, value in c_layout.rollback_from:
        assert Phase[name] == value
    # No op is both a forward op and a rollback op.
    forward = {op for op, *_ in c_layout.phase_ops}
    assert forward.isdisjoint(op for op, *_ in c_layout.rollback_ops)
