"""The coordinator loads only a driver it trusts (engine/driver_trust.py, which the
command line's ``--driver auto`` and the library's default native calls apply): a shim's report
of which ``libcuda.so.1`` it runs on is the workload's word, and loading a library runs
its constructors in the coordinator.

Fake participants report the path; a library whose constructor writes a file stands
for the attacker's. Refused, with the path, the pid and what to do, and the file
never written; the simulated driver (by its path, or a link to it) and the system's
(the one the linker finds) accepted, the coordinator's own path loaded; through
``--proc-root`` the process's mappings decide, not a lookup of its path here.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuinterpose import cli, drivers
from cuinterpose.engine import artifacts, discovery, driver_trust
from cuinterpose.engine.native_checkpoint import NativeUnavailableError
from cuinterpose.engine.wire import Op, Phase
from engine_harness import Team, short_dir, team_of
from test_agent import TOPOLOGY

EVIL = r"""
#include <stdio.h>
__attribute__((constructor)) static void evil(void)
{
    FILE *f = fopen(MARKER, "w");
    if (f)
        fclose(f);
}
"""


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def evil_library(work: Path) -> tuple[Path, Path]:
    """A shared library whose constructor writes ``marker``: what a hostile socket names."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in library")
    source, library, marker = work / "evil.c", work / "evil.so", work / "constructor-ran"
    source.write_text(EVIL)
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(library),
                    str(source)], check=True, timeout=60)  # fmt: skip
    return library, marker


def reporting(team: Team, path: str | Path) -> list[int]:
    for fake in team.fakes:
        fake.driver = str(path)
    return [e.observed_pid for e in team.endpoints]


def sim() -> Path:
    return artifacts.sim_library_dir() / driver_trust.DRIVER_NAME


def test_a_driver_the_coordinator_does_not_know_is_refused_and_never_loaded(work: Path) -> None:
    library, marker = evil_library(work)
    with team_of(TOPOLOGY, work / "control") as team:
        pids = reporting(team, library)
        with pytest.raises(NativeUnavailableError) as info:
            drivers.library("auto", lambda: team.endpoints)
        err = io.StringIO()
        code = cli.main(["suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                         str(team.control_dir), *team.processes, "--progress", "none"],
                        stdout=io.StringIO(), stderr=err)  # fmt: skip
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
    text = str(info.value)
    assert f"refused to load the CUDA driver {library} that pid {pids[0]} reports" in text
    assert f"this installation's simulated driver {sim()}" in text, text
    assert "--driver system" in text and "--driver sim" in text
    assert code == cli.EXIT_FAILED and f"the CUDA driver {library} that pid" in err.getvalue()
    assert not marker.exists()  # its constructor never ran here


def test_the_simulated_driver_is_accepted_by_file_and_loaded_by_its_own_path(
    work: Path,
) -> None:
    link = work / "elsewhere" / driver_trust.DRIVER_NAME
    link.parent.mkdir()
    link.symlink_to(sim())
    with team_of(TOPOLOGY, work / "control") as team:
        reporting(team, sim())
        assert drivers.library("auto", lambda: team.endpoints) == str(sim())
        reporting(team, link)  # the same file by another name: our own path is loaded
        assert drivers.library("auto", lambda: team.endpoints) == str(sim())
        reporting(team, "libcuda.so.1")
        with pytest.raises(NativeUnavailableError, match="is not an absolute path"):
            drivers.library("auto", lambda: team.endpoints)


def test_the_system_driver_the_linker_finds_is_accepted(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = work / "lib" / driver_trust.DRIVER_NAME
    system.parent.mkdir()
    shutil.copy(sim(), system)  # another file than the simulated one
    monkeypatch.setenv("LD_LIBRARY_PATH", str(system.parent))
    assert driver_trust.system_drivers()[0] == system
    with team_of(TOPOLOGY, work / "control") as team:
        reporting(team, system)
        assert drivers.library("auto", lambda: team.endpoints) == str(system)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(work / "nothing"))
    with team_of(TOPOLOGY, work / "control") as team:
        reporting(team, system)
        with pytest.raises(NativeUnavailableError, match="it is another file"):
            drivers.library("auto", lambda: team.endpoints)


def maps(proc: Path, pid: int, path: str, of: Path) -> None:
    st = os.stat(of)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "maps").write_text(
        f"7f0000000000-7f0000001000 r-xp 00000000 {dev} {st.st_ino}                  {path}\n"
    )


def test_through_proc_root_the_process_mappings_decide(work: Path) -> None:
    library, marker = evil_library(work)
    proc = work / "proc"
    inside = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"  # the container's path, not ours
    with team_of(TOPOLOGY, work / "control") as team:
        pids = reporting(team, inside)
        for pid in pids:
            maps(proc, pid, inside, sim())
        report = discovery.shim_drivers(team.endpoints)
        assert driver_trust.trusted(report, proc) == str(sim())
        maps(proc, pids[1], inside, library)  # one maps another file under that name
        with pytest.raises(NativeUnavailableError, match=f"pid {pids[1]} reports: it is another"):
            driver_trust.trusted(report, proc)
        maps(proc, pids[1], "/elsewhere/libcuda.so.1", sim())
        with pytest.raises(NativeUnavailableError, match=f"it maps no file {inside}"):
            driver_trust.trusted(report, proc)
    assert not marker.exists()


def test_a_cli_suspend_asks_its_shims_once_before_handshake_and_loads_what_they_said(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cuinterpose suspend --driver auto``: the driver the native calls load is the one
    the suspend's own STATUS round reported (drivers.LateBackend given its answer), so each
    shim receives exactly one STATUS before HANDSHAKE; the driver is loaded at the first
    native call, once."""
    from test_agent import PIDS, running

    fake = running(PIDS)
    loaded: list[str | None] = []

    def backend(library: str | None = None) -> object:
        loaded.append(library)
        return fake

    monkeypatch.setattr(driver_trust, "CudaBackend", backend)
    with team_of(TOPOLOGY, work / "control") as team:
        reporting(team, sim())
        err = io.StringIO()
        code = cli.main(["suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                         str(team.control_dir), *team.processes, "--progress", "none"],
                        stdout=io.StringIO(), stderr=err)  # fmt: skip
        assert code == cli.EXIT_OK, err.getvalue()
        for f in team.fakes:
            ops = f.received
            assert ops[: ops.index(Op.HANDSHAKE)] == [Op.STATUS], ops
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}
    assert loaded == [str(sim())]
    assert {s.name for s in fake.states.values()} == {"CHECKPOINTED"}


def test_whether_a_driver_needs_asan_is_read_from_its_dynamic_section(work: Path) -> None:
    """The sanitizer build's simulated driver needs libasan, the release one does not;
    a file that is no ELF64 library (or is cut short) is left to the loader to refuse."""
    from cuinterpose.engine.native_checkpoint import _elf_needed, _needs_asan

    builds = {p.parent.parent.parent.name: p for p in artifacts.sim_drivers()}
    if "build-asan" not in builds or "build" not in builds:
        pytest.skip(f"needs both builds' simulated drivers, found {sorted(builds)}")
    assert _needs_asan(str(builds["build-asan"]))
    assert not _needs_asan(str(builds["build"]))
    assert b"libc.so.6" in _elf_needed(str(builds["build"]))
    text = work / "libcuda.so.1"
    text.write_text("not a library\n")
    assert not _needs_asan(str(text))
    cut = work / "cut.so"
    cut.write_bytes(builds["build-asan"].read_bytes()[:200])
    assert not _needs_asan(str(cut))


def test_the_library_default_refuses_a_driver_it_does_not_trust_and_an_agents_own_is_kept(
    work: Path,
) -> None:
    """``cuinterpose.engine.suspend`` / ``resume`` with ``native`` left to its default
    (README's embedding example) hold the driver a shim reports to the same rule as the
    command line: a socket in the control directory answering ASK_DRIVER with its own
    ``libcuda.so.1`` is refused, naming the path, the pid and why, before anything
    changes, and the library's constructor never runs in the agent. An agent that
    passes its own backend chose its driver: it is used as given."""
    from cuinterpose import engine
    from test_agent import running

    library, marker = evil_library(work)
    where = engine.Where(work / "control")
    with team_of(TOPOLOGY, where.control_dir) as team:
        pids = reporting(team, library)
        group = [(p, p) for p in pids]
        with pytest.raises(NativeUnavailableError) as info:
            engine.suspend(group, work / "ckpt", where=where)
        text = str(info.value)
        assert f"refused to load the CUDA driver {library} that pid {pids[0]} reports" in text
        assert "it is another file, not one this coordinator trusts" in text, text
        assert "CudaBackend(library=PATH)" in text
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
        assert not (work / "ckpt" / "manifest.json").exists()
        with pytest.raises(NativeUnavailableError, match=f"driver {library} that pid"):
            engine.native_for(where, group)  # the native calls alone, the same rule

        fake = running(pids)  # the agent's own backend: its choice, not the report's
        done = engine.suspend(group, work / "ckpt", where=where, native=fake)
        assert done.manifest.origin is not None and done.manifest.origin.driver == str(library)
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}
        with pytest.raises(NativeUnavailableError, match=f"driver {library} that pid {pids[0]}"):
            engine.resume(work / "ckpt")
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}  # nothing changed
        for f in team.fakes:
            f.driver = ""  # no shim says: the manifest's record is held to the same rule
        with pytest.raises(NativeUnavailableError, match=f"driver {library} that the manifest"):
            engine.resume(work / "ckpt")
        engine.resume(work / "ckpt", native=fake)
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
    assert not marker.exists()  # its constructor never ran in the agent


def _in_new_mount_namespace(
    over: Path, library: Path, argv: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``argv`` run in a mount namespace of its own (``unshare --mount``) where
    ``library`` is bind-mounted over ``over``: a pod's ``libcuda.so.1`` over this
    installation's simulated driver, as a coordinator that entered the pod sees it."""
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         str(library), str(over), *argv],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --mount and mount --bind need root")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare (util-linux)")
def test_a_coordinator_in_another_mount_namespace_loads_no_driver_from_it(work: Path) -> None:
    """A coordinator run inside a pod's mount namespace sees the pod's files at its own
    paths: a library mounted over the simulated driver passes the file-identity check
    there. It loads no driver from it (specs/detection.md "Driver trust"): the command
    refuses, naming the namespace and the way, whether the shims' report or ``--driver
    sim`` names the path, and the library's constructor never runs. Only the namespace
    named as trusted (``CUINTERPOSE_TRUSTED_MOUNT_NS``) would load it: the check, not
    the setup, is what keeps it out."""
    library, marker = evil_library(work)
    command = str(Path(sys.executable).with_name("cuinterpose"))
    env = {k: v for k, v in os.environ.items() if k != "CUINTERPOSE_TRUSTED_MOUNT_NS"}
    with team_of(TOPOLOGY, work / "control") as team:
        reporting(team, sim())
        suspend = [command, "suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                   str(team.control_dir), *team.processes, "--progress", "none"]  # fmt: skip
        for driver in ("auto", "sim"):
            done = _in_new_mount_namespace(sim(), library, [*suspend, "--driver", driver], env)
            assert done.returncode == cli.EXIT_FAILED, (done.stdout, done.stderr)
            assert "refused to load a CUDA driver: this process runs in mount namespace mnt:[" in (
                done.stderr
            ), done.stderr
            assert "not that of pid 1, the init of its pid namespace" in done.stderr
            assert "--proc-root /proc" in done.stderr and "CUINTERPOSE_TRUSTED_MOUNT_NS" in (
                done.stderr
            )
            assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
            assert not marker.exists(), driver  # its constructor never ran
        trusting = [
            "sh", "-c", 'CUINTERPOSE_TRUSTED_MOUNT_NS=$(readlink /proc/self/ns/mnt) exec "$@"',
            "sh", *suspend,
        ]  # fmt: skip
        _in_new_mount_namespace(sim(), library, trusting, env)
        assert marker.exists()  # told to trust that namespace, the file there is loaded


def _proc(root: Path, self_pid: int, mine: str, init: str) -> Path:
    for pid, link in ((self_pid, mine), (1, init)):
        (root / str(pid) / "ns").mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "ns" / "mnt").symlink_to(link)
    (root / "self").symlink_to(str(self_pid))
    return root


def test_whose_mount_namespace_is_decided_from_a_proc_of_this_pid_namespace(work: Path) -> None:
    """pid 1's namespace alike: trusted; another: refused, naming both ways out; a /proc
    in which this process is not ``self`` (a mount namespace entered without its pid
    namespace: the pod's /proc) is refused before anything is read through it; a
    namespace named in ``CUINTERPOSE_TRUSTED_MOUNT_NS`` trusts that one alone."""
    from cuinterpose.engine import _mountns

    me = os.getpid()
    same = _proc(work / "same", me, "mnt:[7]", "mnt:[7]")
    assert _mountns.foreign(same, {}) is None
    other = _proc(work / "other", me, "mnt:[8]", "mnt:[7]")
    why = _mountns.foreign(other, {})
    assert why is not None and "runs in mount namespace mnt:[8], not that of pid 1" in why
    assert _mountns.foreign(other, {_mountns.TRUST_ENV: "mnt:[8]"}) is None
    why = _mountns.foreign(same, {_mountns.TRUST_ENV: "mnt:[8]"})
    assert why is not None and "not mnt:[8], the one CUINTERPOSE_TRUSTED_MOUNT_NS trusts" in why
    pods = _proc(work / "pods", me + 1, "mnt:[7]", "mnt:[7]")
    why = _mountns.foreign(pods, {_mountns.TRUST_ENV: "mnt:[7]"})
    assert why is not None and f"this process (pid {me}) is not {pods}/self ({me + 1})" in why
