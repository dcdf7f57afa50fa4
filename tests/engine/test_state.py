"""The state file: round trips, atomic writes, and a clear error for every bad file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import pytest
from cuinterpose.engine import statefile as st
from cuinterpose.engine import wire
from cuinterpose.engine.statefile import (
    MAX_STATE_BYTES,
    STATE_FILE_NAME,
    CheckpointState,
    StateFileError,
    StateParticipant,
    read_state,
    write_state,
)
from cuinterpose.engine.topology import Topology
from cuinterpose.engine.wire import BindingKind, RecordKind
from hypothesis import HealthCheck, given, settings
from topologies import (
    participant,
    raw_import,
    replace_records,
    state_of,
    team,
    topologies,
    with_records,
)

WHEN = datetime(2026, 11, 29, 12, 30, 15, 250000, tzinfo=UTC)


def example_state(**team_shape: Any) -> CheckpointState:
    return state_of(team(**team_shape), "host", now=WHEN)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != STATE_FILE_NAME)


# --- round trip -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        {"participants": 1, "allocations": 0, "multicast": False},
        {"participants": 3, "allocations": 2},
        {"participants": 4, "allocations": 1, "binding": BindingKind.BIND_ADDR},
    ],
    ids=repr,
)
@pytest.mark.parametrize("mode", ["host", "native"])
def test_round_trip(tmp_path: Path, shape: dict[str, Any], mode: st.ContentMode) -> None:
    state = state_of(team(**shape), mode, now=WHEN)
    path = write_state(tmp_path, state)
    assert path == tmp_path / STATE_FILE_NAME
    assert read_state(tmp_path) == state
    assert leftovers(tmp_path) == []


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(topology=topologies(max_participants=3, max_records=6))
def test_round_trip_of_any_wire_topology(tmp_path: Path, topology: Topology) -> None:
    # The state file stores whatever the shims reported, valid or not, without loss.
    state = state_of(topology, "native", now=WHEN)
    write_state(tmp_path, state)
    assert read_state(tmp_path) == state


def test_a_state_file_of_protocol_version_1_still_reads(tmp_path: Path) -> None:
    # Version 2 changed no record: what a version-1 coordinator wrote reads the same.
    state = attrs.evolve(example_state(participants=2), protocol_version=1)
    write_state(tmp_path, state)
    assert read_state(tmp_path) == state


def test_from_topology_takes_participants_and_time(tmp_path: Path) -> None:
    state = example_state(participants=2)
    assert state.participants == (
        StateParticipant(participant(0), 1000),
        StateParticipant(participant(1), 1001),
    )
    assert state.created_at == "2026-11-29T12:30:15.250Z"
    assert state.protocol_version == wire.VERSION
    fresh = state_of(team(), "host")
    assert datetime.fromisoformat(fresh.created_at).utcoffset() is not None


def test_overwrites_an_older_state_file(tmp_path: Path) -> None:
    write_state(tmp_path, example_state(participants=1))
    newer = example_state(participants=3)
    write_state(tmp_path, newer)
    assert read_state(tmp_path) == newer
    assert leftovers(tmp_path) == []


def test_file_is_readable_json_without_secrets(tmp_path: Path) -> None:
    path = write_state(tmp_path, example_state(participants=2, allocations=1))
    text = path.read_text()
    document = json.loads(text)
    assert list(document) == [
        "format",
        "version",
        "protocol_version",
        "content_mode",
        "created_at",
        "participants",
        "topology",
    ]
    assert (document["format"], document["version"]) == ("cuinterpose.state", 2)
    records = document["topology"]["participants"][0]["records"]
    first = records[0]
    assert first["kind"] == "ALLOCATION"
    assert first["flags"] == ["CREATOR", "HANDLE_LIVE", "CONTENT"]
    assert first["id"] == "10" * 16
    assert first["creator"] == participant(0)
    mapping = next(r for r in records if r["kind"] == "MAPPING")
    assert mapping["access"] == [{"location_type": 1, "location_id": 0, "flags": 3}]
    assert "member_id" not in mapping  # zero fields are left out
    for word in ("authorization", "fd", "token", "bytes"):
        assert f'"{word}"' not in text
    # One record per line, for reviewers and diffs.
    assert sum(1 for line in text.splitlines() if '"kind": ' in line) == sum(
        len(p["records"]) for p in document["topology"]["participants"]
    )


def test_converter_is_fresh_per_call() -> None:
    assert st.make_converter() is not st.make_converter()


# --- atomic write -------------------------------------------------------------------


def _fail(*args: object, **kwargs: object) -> None:
    raise OSError(5, "Input/output error (injected)")


@pytest.mark.parametrize("target", ["fsync", "replace"])
def test_failed_write_leaves_no_temp_file_and_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    old = example_state(participants=1)
    write_state(tmp_path, old)
    monkeypatch.setattr(os, target, _fail)
    with pytest.raises(StateFileError) as raised:
        write_state(tmp_path, example_state(participants=3))
    monkeypatch.undo()
    assert "injected" in str(raised.value)
    assert str(tmp_path / STATE_FILE_NAME) in str(raised.value)
    assert leftovers(tmp_path) == []
    assert read_state(tmp_path) == old


def test_interrupted_write_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_state(tmp_path, example_state())
    assert list(tmp_path.iterdir()) == []


def test_unencodable_state_is_refused_before_any_file(tmp_path: Path) -> None:
    topology = replace_records(team(), participant(1), kind=RecordKind.MAPPING, size=1 << 64)
    bad = state_of(topology, "host", now=WHEN)
    with pytest.raises(
        StateFileError,
        match=rf"participant {participant(1)} record \d+ \(MAPPING\): size {1 << 64} does not"
        r" fit u64",
    ):
        write_state(tmp_path, bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"created_at": "yesterday"}, "not an ISO 8601 time"),
        ({"created_at": "2026-11-29T12:30:15+02:00"}, "not in UTC"),
        ({"protocol_version": 3}, "protocol_version 3; this engine reads 1 and 2"),
        ({"participants": ()}, "participants and topology disagree"),
        (
            {"participants": (StateParticipant("XYZ", 1),)},
            "participant id 'XYZ' is not 32 lowercase hex",
        ),
    ],
)
def test_inconsistent_state_is_not_written(
    tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    with pytest.raises(StateFileError, match=says):
        write_state(tmp_path, attrs.evolve(example_state(), **change))
    assert list(tmp_path.iterdir()) == []


def test_directory_sync_failure_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync
    calls: list[int] = []

    def second_fsync_fails(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the first syncs the file, the second the directory
            raise OSError(5, "directory sync failed (injected)")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", second_fsync_fails)
    with pytest.raises(StateFileError, match=r"written, but syncing .* failed"):
        write_state(tmp_path, example_state())
    assert leftovers(tmp_path) == []


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StateFileError, match="cannot create a temporary file"):
        write_state(tmp_path / "absent", example_state())


# --- bad files ----------------------------------------------------------------------


def good_document(tmp_path: Path) -> dict[str, Any]:
    path = write_state(tmp_path, example_state(participants=2))
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def rewrite(tmp_path: Path, document: object) -> None:
    (tmp_path / STATE_FILE_NAME).write_text(json.dumps(document))


def expect_error(tmp_path: Path, *fragments: str) -> StateFileError:
    with pytest.raises(StateFileError) as raised:
        read_state(tmp_path)
    message = str(raised.value)
    assert str(tmp_path / STATE_FILE_NAME) in message
    for fragment in fragments:
        assert fragment in message, message
    return raised.value


def test_missing(tmp_path: Path) -> None:
    expect_error(tmp_path, "is missing")
    expect_error(tmp_path / "nope", "is missing")


def test_not_a_file(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE_NAME).mkdir()
    expect_error(tmp_path, "not a regular file")


@pytest.mark.parametrize("content", [b"", b"  \n"])
def test_empty(tmp_path: Path, content: bytes) -> None:
    (tmp_path / STATE_FILE_NAME).write_bytes(content)
    expect_error(tmp_path, "is empty")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.99])
def test_truncated(tmp_path: Path, keep: float) -> None:
    path = write_state(tmp_path, example_state(participants=3))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    expect_error(tmp_path, "is truncated")


def test_corrupt_json(tmp_path: Path) -> None:
    path = write_state(tmp_path, example_state())
    path.write_bytes(path.read_bytes().replace(b'"version": 2', b'"version" 2'))
    expect_error(tmp_path, "is corrupt: not valid JSON", "line 3,")


def test_not_utf8(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE_NAME).write_bytes(b'{"format": "\xff\xfe"}')
    expect_error(tmp_path, "not UTF-8")


def test_not_an_object(tmp_path: Path) -> None:
    rewrite(tmp_path, ["cuinterpose.state", 1])
    expect_error(tmp_path, "not a JSON object but a list")


def test_foreign_format(tmp_path: Path) -> None:
    document = good_document(tmp_path)
    document["format"] = "criu.inventory"
    rewrite(tmp_path, document)
    expect_error(tmp_path, "has format 'criu.inventory'", "not a cuinterpose state file")


def test_no_format(tmp_path: Path) -> None:
    rewrite(tmp_path, {"version": 1, "hello": "world"})
    expect_error(tmp_path, 'no "format" key')


@pytest.mark.parametrize(("version", "says"), [(3, "has version 3"), ("1", "no integer version")])
def test_unknown_version(tmp_path: Path, version: object, says: str) -> None:
    document = good_document(tmp_path)
    document["version"] = version
    rewrite(tmp_path, document)
    expect_error(tmp_path, says)


def test_oversize(tmp_path: Path) -> None:
    with (tmp_path / STATE_FILE_NAME).open("wb") as handle:
        handle.truncate(MAX_STATE_BYTES + 1)  # sparse: costs no disk
    expect_error(tmp_path, f"over the {MAX_STATE_BYTES}-byte cap")


def test_oversize_bytes_are_refused_even_if_read_some_other_way(tmp_path: Path) -> None:
    with pytest.raises(StateFileError, match="over the"):
        st.decode_state(b" " * MAX_STATE_BYTES + b"{}", tmp_path / STATE_FILE_NAME)


def _edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return edit


def _records(document: dict[str, Any], n: int = 0) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = document["topology"]["participants"][n]["records"]
    return records


BAD_CONTENT = [
    pytest.param(
        lambda d: d.update(extra=1), ["extra fields found (extra) @ $"], id="extra-top-level-key"
    ),
    pytest.param(
        lambda d: _records(d)[0].update(fd=7),
        ["extra fields found (fd) @ $.topology.participants[0].records[0]"],
        id="extra-record-key",
    ),
    pytest.param(
        lambda d: _records(d)[1].update(kind="GHOST"),
        ["unknown RecordKind 'GHOST'", "$.topology.participants[0].records[1].kind"],
        id="unknown-kind",
    ),
    pytest.param(
        lambda d: _records(d)[0].update(flags=["CREATOR", "SHINY"]),
        ["unknown record flag 'SHINY'"],
        id="unknown-flag",
    ),
    pytest.param(
        lambda d: _records(d)[0].update(flags=["CREATOR", "CREATOR"]),
        ["listed twice"],
        id="flag-twice",
    ),
    pytest.param(
        lambda d: next(r for r in _records(d) if r["kind"] == "MC_BINDING").update(
            binding_kind="BIND_SOMEHOW"
        ),
        ["unknown BindingKind 'BIND_SOMEHOW'"],
        id="unknown-binding-kind",
    ),
    pytest.param(
        lambda d: d.update(content_mode="cloud"), ["content_mode 'cloud'"], id="content-mode"
    ),
    pytest.param(
        lambda d: d["participants"][0].update(participant="A0" * 16),
        ["participants: participant id 'A0A0", "not 32 lowercase hex"],
        id="participant-id-uppercase",
    ),
    pytest.param(
        lambda d: d["topology"]["participants"][1].update(participant="abc"),
        ["topology: participant id 'abc'"],
        id="topology-participant-id-short",
    ),
    pytest.param(
        lambda d: _records(d)[0].update(creator="nobody"),
        ["record 0 (ALLOCATION)", "creator 'nobody'"],
        id="creator-id",
    ),
    pytest.param(
        lambda d: _records(d)[0].update(id="1010"),
        ["resource id '1010' is not 32 lowercase hex digits", "records[0].id"],
        id="resource-id-short",
    ),
    pytest.param(
        lambda d: _records(d)[0].update(id="XY" * 16),
        ["is not 32 lowercase hex digits"],
        id="resource-id-not-hex",
    ),
    pytest.param(
        lambda d: d["participants"][0].update(pid="1000"),
        ["expected an integer, got '1000' @ $.participants[0].pid"],
        id="pid-string",
    ),
    pytest.param(
        lambda d: d["participants"][0].update(pid=True),
        ["expected an integer, got True"],
        id="pid-bool",
    ),
    pytest.param(
        lambda d: _records(d)[0].update(size=1.5),
        ["expected an integer, got 1.5"],
        id="size-float",
    ),
    pytest.param(
        lambda d: _records(d)[0].update(size=-1),
        ["record 0 (ALLOCATION): size -1 does not fit u64"],
        id="size-negative",
    ),
    pytest.param(
        lambda d: d["participants"][0].update(pid=0),
        ["has pid 0, not a pid"],
        id="pid-zero",
    ),
    pytest.param(
        lambda d: d["participants"].pop(), ["participants and topology disagree"], id="pid-gone"
    ),
    pytest.param(
        lambda d: d["participants"][1].update(pid=4242),
        ["participants and topology disagree"],
        id="pid-differs",
    ),
    pytest.param(
        lambda d: d["participants"].append(dict(d["participants"][0])),
        ["is listed twice"],
        id="participant-twice",
    ),
    pytest.param(
        lambda d: d["topology"].update(participants={"a": 1}),
        ["expected a list, got dict"],
        id="dict-for-list",
    ),
    pytest.param(
        lambda d: d.pop("created_at"), ["required field missing @ $.created_at"], id="missing-key"
    ),
    pytest.param(
        lambda d: d.update(created_at="2026-13-45"), ["not an ISO 8601 time"], id="bad-time"
    ),
    pytest.param(lambda d: d.update(protocol_version=7), ["protocol_version 7"], id="protocol"),
    pytest.param(
        lambda d: _records(d)[0].update(access=[{"location_type": 1}] * 9),
        ["required field missing"],
        id="access-incomplete",
    ),
]


@pytest.mark.parametrize(("edit", "fragments"), BAD_CONTENT)
def test_bad_content(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], fragments: list[str]
) -> None:
    document = good_document(tmp_path)
    edit(document)
    rewrite(tmp_path, document)
    expect_error(tmp_path, *fragments)


def test_nine_access_descriptors_are_refused(tmp_path: Path) -> None:
    document = good_document(tmp_path)
    mapping = next(r for r in _records(document) if r["kind"] == "MAPPING")
    mapping["access"] = [{"location_type": 1, "location_id": n, "flags": 3} for n in range(9)]
    rewrite(tmp_path, document)
    expect_error(tmp_path, "9 access descriptors")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"format": "cuinterpose.state", "format": "x"}', "key 'format' appears twice"),
        ('{"format": "cuinterpose.state", "version": NaN}', "NaN is not a number JSON allows"),
    ],
)
def test_json_that_python_would_accept_is_refused(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / STATE_FILE_NAME).write_text(text)
    expect_error(tmp_path, says)


def test_error_carries_path_and_problem(tmp_path: Path) -> None:
    error = expect_error(tmp_path, "is missing")
    assert error.path == tmp_path / STATE_FILE_NAME
    assert error.problem.startswith("is missing")


def test_a_refused_capture_topology_still_round_trips(tmp_path: Path) -> None:
    # RAW_IMPORT records never reach a written state in practice (preflight refuses), but
    # the codec must not be the thing that loses them.
    state = state_of(
        with_records(team(), participant(0), raw_import()), "host", now=WHEN
    )
    write_state(tmp_path, state)
    assert read_state(tmp_path) == state


def test_the_example_in_the_spec_reads_back_and_is_what_the_engine_writes(tmp_path: Path) -> None:
    spec = Path(__file__).resolve().parents[2] / "specs" / "state-file.md"
    example = spec.read_text().split("```json\n", 1)[1].split("```", 1)[0]
    state = st.decode_state(example.encode(), spec)
    assert state.topology == team(participants=2, allocations=1, multicast=False)
    assert st.encode_state(state).decode() == example


def test_a_version_1_file_reads_with_its_pairs_unrecorded_and_version_2_records_them(
    tmp_path: Path,
) -> None:
    """Version 1 (namespace pids only) still reads, each pair taken as the pid twice;
    version 2 records the coordinator's pid, start time and pid namespace, and a
    version 1 file carrying them is refused."""
    state = example_state(participants=2, allocations=1)
    path = write_state(tmp_path, state)
    document = json.loads(path.read_text())
    document["version"] = 1
    rewrite(tmp_path, document)
    old = read_state(tmp_path)
    assert [p.pair() for p in old.participants] == [(p.pid, p.pid) for p in old.participants]
    paired = attrs.evolve(state, participants=tuple(
        attrs.evolve(p, observed_pid=4000 + i, started=77, pid_namespace=4026531836)
        for i, p in enumerate(state.participants)))  # fmt: skip
    write_state(tmp_path, paired)
    back = read_state(tmp_path)
    assert [p.pair() for p in back.participants] == [
        (4000 + i, p.pid) for i, p in enumerate(state.participants)
    ]
    document = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    document["version"] = 1
    rewrite(tmp_path, document)
    expect_error(tmp_path, "version 1 participants have two keys")
