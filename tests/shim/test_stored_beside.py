"""The staged bytes beside the images through the library, on real shims and the simulated
driver (engine/stored.py, specs/criu.md "The stored format"): what a resume refuses
before its native restore, and what ``recover`` fetches back.

A creator/importer group suspended with ``store_beside=True`` (what the CRIU verbs do):
- a part cut short, one others may write, one owned by uid 65534, one replaced by a
  symbolic link, an earlier store's parts put in place of the newer ones: the resume
  refuses each before its native restore (every process still CHECKPOINTED), naming the
  file and, for another store's part, both identities; the true parts put back, the
  resume brings every byte back;
- the coordinator gone after its store (the processes natively restored and unlocked by
  hand, the shims PREPARED with their bytes only in the files): ``cuinterpose recover``
  fetches them back (every stripe's sum checked) and the group runs with its bytes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cuinterpose.engine import agent, criu, stored
from cuinterpose.engine.native_checkpoint import ProcessState

from tests.shim.agentgroup import Group, WorkerBackend, build_group
from tests.simenv import Spawn
from tests.waiting import wait_until


@pytest.fixture
def group(spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str]) -> Group:
    return build_group(spawn, shim_env, plain_env)


def suspended(group: Group, ckpt: Path, control_dir: Path) -> WorkerBackend:
    native = WorkerBackend(group.observer)
    agent.suspend(
        group.processes, ckpt, where=agent.Where(control_dir), native=native, store_beside=True
    )
    assert {native.state(p) for p in group.pids} == {ProcessState.CHECKPOINTED}
    return native


def running_with_its_bytes(group: Group, control_dir: Path) -> None:
    """Every process natively RUNNING, its shim ACTIVE, every byte as written."""
    native = WorkerBackend(group.observer)
    rows = agent.status(group.processes, agent.Where(control_dir), native)
    assert {(r.native_state, r.shim_phase) for r in rows} == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()


def recovered(group: Group, ckpt: Path, control_dir: Path, plain_env: dict[str, str]) -> None:
    """``cuinterpose recover`` of the group from ``ckpt``, as a person types it; then
    running_with_its_bytes."""
    args = ["recover", "--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir)]
    args += [w for p in group.pids for w in ("--process", str(p), str(p))]
    done = run_cli([*args, "--driver", "sim"], plain_env)
    assert done.returncode == 0, done.stderr + done.stdout
    running_with_its_bytes(group, control_dir)


def refused_before_the_native_restore(
    group: Group, native: WorkerBackend, ckpt: Path, control_dir: Path, *words: str
) -> None:
    with pytest.raises(stored.StoreFailed) as info:
        agent.resume(ckpt, where=agent.Where(control_dir), native=native)
    text = str(info.value)
    assert text.startswith("resume refused: the staged bytes"), text
    assert "nothing was changed" in text, text
    for word in words:
        assert word in text, text
    assert not info.value.changed
    assert {native.state(p) for p in group.pids} == {ProcessState.CHECKPOINTED}


def test_bad_parts_are_refused_before_the_native_restore(
    group: Group, control_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    native = suspended(group, ckpt, control_dir)
    part = max(stored.stored_files(ckpt), key=lambda p: p.stat().st_size)  # one with data
    good = part.read_bytes()
    part.write_bytes(good[:-1])  # cut short by one byte
    refused_before_the_native_restore(group, native, ckpt, control_dir, f"{part} has")
    part.write_bytes(good)
    for mode, owner, words in [
        (0o666, 0, "is writable by group or others (mode 0666)"),
        (0o600, 65534, "is owned by uid 65534"),
    ]:
        if owner and os.geteuid() != 0:
            continue  # a file of uid 65534 needs root to make
        os.chmod(part, mode)
        os.chown(part, owner, owner)
        refused_before_the_native_restore(group, native, ckpt, control_dir, str(part), words)
    os.chown(part, 0, 0)
    os.chmod(part, 0o600)
    kept = tmp_path / "kept.bin"
    part.rename(kept)
    part.symlink_to(kept)
    refused_before_the_native_restore(
        group, native, ckpt, control_dir, f"{part} is a symbolic link (never followed)"
    )
    part.unlink()
    kept.rename(part)
    agent.resume(ckpt, where=agent.Where(control_dir), native=native)
    assert group.mismatches() == []
    group.close()


def test_an_earlier_stores_parts_are_refused_naming_both_identities(
    group: Group, control_dir: Path, tmp_path: Path
) -> None:
    """Suspended, resumed, suspended again into the same directory: the first store's
    parts (the same processes, the same sizes) copied over the second's are refused by
    the identity they carry, naming both; the second's put back, every byte returns."""
    ckpt, earlier, newer = tmp_path / "ckpt", tmp_path / "earlier", tmp_path / "newer"
    native = suspended(group, ckpt, control_dir)
    first = stored.recorded_identity(ckpt)
    shutil.copytree(ckpt, earlier)
    agent.resume(ckpt, where=agent.Where(control_dir), native=native)
    suspended(group, ckpt, control_dir)
    second = stored.recorded_identity(ckpt)
    assert first and second and first != second
    shutil.copytree(ckpt, newer)
    for path in stored.stored_files(ckpt):
        shutil.copy2(earlier / path.name, path)
    refused_before_the_native_restore(
        group, native, ckpt, control_dir, f"is of dump {first}, not of dump {second}"
    )
    for path in stored.stored_files(ckpt):
        shutil.copy2(newer / path.name, path)
    agent.resume(ckpt, where=agent.Where(control_dir), native=native)
    assert group.mismatches() == []
    group.close()


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = dict(env)
    env.pop("SNAPSHOT_CONTROL_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_recover_fetches_what_the_shims_stored(
    group: Group, control_dir: Path, tmp_path: Path, plain_env: dict[str, str]
) -> None:
    """The coordinator gone once its store was done (its manifest removed: as if killed
    before writing it), the processes brought back natively by hand: the shims are
    PREPARED with their bytes only in the files, and ROLLBACK_ALLOCATIONS would refuse
    (FETCH_STAGED first). ``cuinterpose recover`` fetches them and rolls back: every
    byte back."""
    ckpt = tmp_path / "ckpt"
    native = suspended(group, ckpt, control_dir)
    (ckpt / agent.MANIFEST_FILE_NAME).unlink()
    for pid in group.pids:
        native.restore(pid)
        native.unlock(pid)
    recovered(group, ckpt, control_dir, plain_env)


def test_recover_after_a_coordinator_killed_before_its_store_reached_the_shims(
    group: Group, control_dir: Path, tmp_path: Path, plain_env: dict[str, str]
) -> None:
    """The coordinator killed between making the parts and its STORE_STAGED: the parts
    are empty and every shim still holds its bytes in memory. ``cuinterpose recover``
    must not refuse the empty parts: the shims read none of them, and the group comes
    back with every byte (the CRIU verb's own kill races this moment; here it is made)."""
    ckpt = tmp_path / "ckpt"
    native = WorkerBackend(group.observer)
    agent.suspend(group.processes, ckpt, where=agent.Where(control_dir), native=native)
    ids = [p.participant for p in agent.read_manifest(ckpt).participants if p.participant]
    stored.record_identity(ckpt, stored.new_identity())
    for i in ids:
        for k in range(2):
            os.close(os.open(stored.part_path(ckpt, i, k), os.O_CREAT | os.O_EXCL, 0o600))
    (ckpt / agent.MANIFEST_FILE_NAME).unlink()
    recovered(group, ckpt, control_dir, plain_env)


def stand_in_criu(path: Path) -> Path:
    """A ``criu`` that says it is 4.2, passes ``check``, and whose dump never returns."""
    path.write_text(
        '#!/bin/sh\ncase "$1" in\n  --version) echo "Version: 4.2" ;;\n'
        "  dump) exec sleep 60 ;;\nesac\n"
    )
    path.chmod(0o755)
    return path


def idle(group: Group, control_dir: Path, native: WorkerBackend) -> bool:
    """No shim of the group has a phase op in flight (a STORE the dead coordinator sent
    runs to its end in the shim)."""
    rows = agent.status(group.processes, agent.Where(control_dir), native)
    return all(r.in_flight is None or r.in_flight.op is None for r in rows)


def test_criu_dump_killed_during_its_store_then_recover(
    group: Group, control_dir: Path, tmp_path: Path, plain_env: dict[str, str]
) -> None:
    """``cuinterpose criu dump`` killed (SIGKILL, with its process group) once it created
    the parts, while its shims store into them beside the native lock and checkpoint:
    no manifest, or one without images. ``cuinterpose recover`` takes back whatever native
    states the dead run left, fetches the stored bytes (every stripe's sum checked) and
    the group runs with every byte."""
    ckpt, images = tmp_path / "ckpt", tmp_path / "images"
    env = {k: v for k, v in plain_env.items() if k != "SNAPSHOT_CONTROL_DIR"}
    argv = [sys.executable, "-m", "cuinterpose", "criu", "dump", "--checkpoint-dir", str(ckpt),
            "--images-dir", str(images), "--control-dir", str(control_dir), "--criu",
            str(stand_in_criu(tmp_path / "criu")), "--tree", str(os.getpid()),
            *(w for p in group.pids for w in ("--process", str(p), str(p)))]  # fmt: skip
    run = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        wait_until(lambda: len(stored.stored_files(ckpt)) >= 2 or run.poll() is not None,
                   "the dump created its parts")  # fmt: skip
        assert run.poll() is None, run.communicate()[1]
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
    native = WorkerBackend(group.observer)
    wait_until(lambda: idle(group, control_dir, native), "the shims' store ran to its end")
    # Whatever mix of native states the dead run left (LOCKED, CHECKPOINTED): recover
    # takes it back itself.
    recovered(group, ckpt, control_dir, plain_env)


def criu_that_outlives(path: Path, finished: bool) -> Path:
    """A ``criu`` whose dump says it started (``started`` in the images directory), waits
    for ``go`` there (the test writes it once the coordinator is dead), then writes a
    page file and its log, ending as CRIU's ends when the dump finished or failed, and
    ``ended``. It kills no tree: the processes stay as a failed dump leaves them."""
    last, code = ("Dumping finished successfully", 0) if finished else ("Dumping FAILED.", 1)
    path.write_text(
        "#!/bin/sh\n"
        'dir=""; log=""; prev=""\n'
        'for a in "$@"; do [ "$prev" = -D ] && dir=$a; [ "$prev" = -o ] && log=$a; prev=$a; done\n'
        'case "$1" in\n'
        '  --version) echo "Version: 4.2" ;;\n'
        '  dump) touch "$dir/started"\n'
        '    while [ ! -e "$dir/go" ]; do sleep 0.05; done\n'
        '    echo "host pages" >"$dir/pages-1.img"\n'
        f'    printf "(00.10) Writing stats\\n(00.20) {last}\\n" >"$log"\n'
        f'    touch "$dir/ended"; exit {code} ;;\n'
        "esac\n"
    )
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("whole_group", [False, True], ids=["itself", "its-process-group"])
@pytest.mark.parametrize("finished", [True, False], ids=["criu-finished", "criu-failed"])
def test_criu_dump_killed_as_criu_starts(
    group: Group,
    control_dir: Path,
    tmp_path: Path,
    plain_env: dict[str, str],
    finished: bool,
    whole_group: bool,
) -> None:
    """``cuinterpose criu dump`` killed (SIGKILL: itself alone, or its whole process group, as
    a terminal's end or ``kill -9 -PGID`` does) once its ``criu dump`` child started; CRIU
    carries on (a session of its own). Finished: its images are the group's (the manifest
    and the images name the staged parts' identity from before CRIU ran) and a restore takes
    them. Failed: a restore refuses them, saying the dump did not finish and which command
    brings the group back; that command does, every byte checked. Either way ``cuinterpose
    resume`` on the tree CRIU left (the stand-in kills none) brings every byte back, the
    parts fetched under the images' identity."""
    ckpt, images = tmp_path / "ckpt", tmp_path / "images"
    env = {k: v for k, v in plain_env.items() if k != "SNAPSHOT_CONTROL_DIR"}
    argv = [sys.executable, "-m", "cuinterpose", "criu", "dump", "--checkpoint-dir", str(ckpt),
            "--images-dir", str(images), "--control-dir", str(control_dir), "--criu",
            str(criu_that_outlives(tmp_path / "criu", finished)), "--tree", str(os.getpid()),
            *(w for p in group.pids for w in ("--process", str(p), str(p)))]  # fmt: skip
    run = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: (images / "started").exists() or run.poll() is not None,
                   "criu dump started")  # fmt: skip
        assert run.poll() is None, run.communicate()[1]
    finally:
        if whole_group:  # every process of the command's group: its criu is in none
            os.killpg(run.pid, signal.SIGKILL)
        else:
            run.kill()
        run.communicate()
    (images / "go").touch()
    wait_until(lambda: (images / "ended").exists(), "criu dump ended")
    manifest = agent.read_manifest(ckpt)
    assert manifest.images is not None
    assert manifest.images.identity == stored.recorded_identity(ckpt)
    if finished:
        criu.before_restore(ckpt, None, images)  # the images are the group's
    else:
        with pytest.raises(agent.ManifestError) as info:
            criu.before_restore(ckpt, None, images)
        text = str(info.value)
        assert "was begun but never sealed, and did not finish" in text, text
        assert "ends with '(00.20) Dumping FAILED.'" in text, text
        assert f"cuinterpose resume --checkpoint-dir {ckpt}" in text, text
    back = run_cli(["resume", "--checkpoint-dir", str(ckpt)], plain_env)
    assert back.returncode == 0, back.stderr + back.stdout
    running_with_its_bytes(group, control_dir)


def test_a_flipped_byte_found_by_the_fetch_then_recover(
    group: Group, control_dir: Path, tmp_path: Path, plain_env: dict[str, str]
) -> None:
    """One data byte flipped (size, header and identity intact): only reading finds it,
    so the resume's fetch refuses it after the native restore, naming the part and the
    stripe, the bytes still in the files. The true part put back, ``cuinterpose
    recover`` fetches it and restores: every byte back."""
    ckpt = tmp_path / "ckpt"
    native = suspended(group, ckpt, control_dir)
    part = max(stored.stored_files(ckpt), key=lambda p: p.stat().st_size)
    good = part.read_bytes()
    bad = bytearray(good)
    bad[-100] ^= 1
    part.write_bytes(bytes(bad))
    with pytest.raises(agent.ResumeFailed) as info:
        agent.resume(ckpt, where=agent.Where(control_dir), native=native)
    text = str(info.value)
    assert "part 0: stripe 0 (file offset 4096" in text and "changed since" in text, text
    part.write_bytes(good)
    recovered(group, ckpt, control_dir, plain_env)
