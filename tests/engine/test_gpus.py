"""engine/gpus.py: --gpu-map parsed, resolved against the manifest's GPUs and the restoring
node's, each refusal of specs/restore.md ("Onto other GPUs") on its own, before anything
changes; a shim's devices report read as hostile."""

from __future__ import annotations

import pytest
from cuinterpose.engine.gpus import (
    Gpu,
    GpuMap,
    GpuMapError,
    GpuMapRefused,
    checkpointed,
    parse_report,
    resolve,
    uuid_bytes,
    uuid_pairs,
    uuid_text,
    wire_text,
)


def uuid(n: int) -> str:
    return uuid_text(bytes([n]) * 16)


H200 = "NVIDIA H200"
GIB = 1 << 30
# The checkpointed node: the group used GPU 0 (two processes) and GPU 1.
OLD = checkpointed(
    [
        (Gpu(0, uuid(0xA0), H200, 3 * GIB), Gpu(1, uuid(0xA1), H200, GIB)),
        (Gpu(0, uuid(0xA0), H200, 2 * GIB),),
    ]
)
HERE = (
    Gpu(0, uuid(0xB0), H200, 141 * GIB),
    Gpu(1, uuid(0xB1), H200, 141 * GIB),
    Gpu(2, uuid(0xB2), "NVIDIA H100", 80 * GIB),
    Gpu(3, uuid(0xB3), H200, 4 * GIB),
)


def refused(text: str) -> str:
    with pytest.raises(GpuMapRefused) as caught:
        resolve(GpuMap.parse(text), OLD, HERE)
    assert "nothing was changed" in caught.value.what
    return "\n".join(caught.value.detail)


def test_the_group_gpus_are_counted_once_with_their_bytes() -> None:
    assert [(g.uuid, g.bytes) for g in OLD] == [(uuid(0xA0), 5 * GIB), (uuid(0xA1), GIB)]


def test_ordinals_and_uuids_resolve_to_uuid_pairs() -> None:
    pairs = resolve(GpuMap.parse(f"0=1,{uuid(0xA1)}={uuid(0xB0)}"), OLD, HERE)
    assert pairs == ((uuid(0xA0), uuid(0xB1)), (uuid(0xA1), uuid(0xB0)))
    assert wire_text(pairs) == f"{uuid(0xA0)}={uuid(0xB1)},{uuid(0xA1)}={uuid(0xB0)}"
    assert uuid_bytes(uuid(0xA0)) == bytes([0xA0]) * 16


def test_a_map_that_misses_a_checkpointed_gpu_is_refused_naming_it() -> None:
    assert f"GPU 1 {uuid(0xA1)} ({H200}) is missing" in refused("0=1")


def test_a_map_that_names_a_gpu_twice_is_refused_naming_it() -> None:
    assert f"checkpointed GPU {uuid(0xA0)} is named 2 times" in refused("0=1,0=0,1=3")
    assert f"target GPU {uuid(0xB1)} is named 2 times" in refused("0=1,1=1")


def test_a_map_onto_another_chip_is_refused_naming_both() -> None:
    text = refused("0=2,1=1")
    assert f"GPU 0 {uuid(0xA0)} ({H200}) cannot go to GPU 2 {uuid(0xB2)}" in text
    assert "another chip" in text


def test_a_map_onto_a_gpu_without_the_memory_is_refused_naming_it() -> None:
    text = refused("0=3,1=1")
    assert f"cannot go to GPU 3 {uuid(0xB3)} (NVIDIA H200): the group used" in text
    assert f"{5 * GIB} bytes there, the GPU has {4 * GIB}" in text


def test_a_map_onto_no_gpu_here_is_refused() -> None:
    assert f"{uuid(0xCC)} is no GPU here" in refused(f"0={uuid(0xCC)},1=1")
    assert "7 is no GPU the group used" in refused("7=1,0=0,1=1")


def test_a_target_that_is_not_here_is_the_one_reason_given() -> None:
    """GPU 0 is named (its target is what is wrong): not said missing as well."""
    assert refused("0=5,1=1").splitlines() == ["5 is no GPU here"]
    assert refused("0=5").splitlines() == [
        "5 is no GPU here",
        f"GPU 1 {uuid(0xA1)} ({H200}) is missing: the mapping must name every GPU the group "
        "used",
    ]


def test_a_coordinator_restore_takes_uuids_only_each_once() -> None:
    assert uuid_pairs(GpuMap.parse(f"{uuid(1)}={uuid(2)}")) == ((uuid(1), uuid(2)),)
    with pytest.raises(GpuMapRefused, match="refused"):
        uuid_pairs(GpuMap.parse(f"0={uuid(2)}"))
    with pytest.raises(GpuMapRefused) as caught:
        uuid_pairs(GpuMap.parse(f"{uuid(1)}={uuid(2)},{uuid(1)}={uuid(3)}"))
    assert f"checkpointed GPU {uuid(1)} is named twice" in caught.value.detail


@pytest.mark.parametrize("text", ["", "0", "0=", "=1", "0=1,", "a=b", "GPU-1=0", "-1=0", "01=1"])
def test_a_map_that_is_not_old_eq_new_is_a_usage_error(text: str) -> None:
    with pytest.raises(GpuMapError, match="is not OLD=NEW"):
        GpuMap.parse(text)


def test_a_devices_report_is_read_strictly() -> None:
    line = f"1\t{uuid(5)}\t4096\tNVIDIA H200"
    assert parse_report(line + "\n") == (Gpu(1, uuid(5), H200, 4096),)
    assert parse_report("") == ()
    for bad in (
        f"x\t{uuid(5)}\t1\tn",
        "1\tGPU-5\t1\tn",
        f"1\t{uuid(5)}\t-1\tn",
        f"1\t{uuid(5)}\t1",
        f"1\t{uuid(5)}\t1\tn\n1\t{uuid(6)}\t1\tn",
    ):
        with pytest.raises(ValueError):
            parse_report(bad)
