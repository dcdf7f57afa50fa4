"""One coordinator at a time, whole teams only, trusted endpoints: on real shims over the
simulated driver (specs/recovery.md, specs/protocol.md).

- The lease: HANDSHAKE with a token takes it; another token is refused with the holder
  named until the holder is gone or releases it; a request without a token is served
  only while nobody holds it (HANDSHAKE and INSPECT always).
- Two coordinators racing ``prepare`` on one team through different checkpoint dirs:
  one capture proceeds, or both are refused; never a wedged group.
- A ``prepare`` that leaves out a live importer is refused before anything changes.
- A control directory that is not trusted gets no socket, and says why.
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cuinterpose.demo import Worker, coordinator_env, pattern_digest
from cuinterpose.engine import wire
from cuinterpose.engine.wire import Op, Phase, Status

from tests.shim import shimenv
from tests.shim.workers.cycle import assert_still_active, cli
from tests.simenv import Spawn
from tests.stranger import NOBODY, served_by_nobody
from tests.waiting import wait_until

SEED = 97
HOLDER_NAMED = "another coordinator holds this process (pid "


def _team(
    spawn: Spawn, shim_env: dict[str, str], importers: int
) -> tuple[Worker, list[Worker], int, int, list[int], int]:
    """A creator whose allocation every importer imports and maps."""
    creator = spawn("creator", shim_env)
    others = [spawn(f"importer{k}", shim_env) for k in range(importers)]
    size = 2 * int(creator.check("granularity")["granularity"])
    handle, va = creator.create_mapped(size, seed=SEED)
    vas = []
    for importer in others:
        fd = int(creator.check("export", handle=handle)["fd"])
        theirs = creator.send_fd_to(importer, fd, close=True)
        imported = int(importer.check("import", fd=theirs)["handle"])
        vas.append(importer.map_at_new_va(imported, size))
    return creator, others, handle, va, vas, size


def _intact(creator: Worker, importers: list[Worker], handle: int, va: int, vas: list[int],
            size: int, seed: int) -> None:  # fmt: skip
    assert_still_active(creator, handle, va, size, seed)
    for importer, at in zip(importers, vas, strict=True):
        assert importer.digest(at, size) == pattern_digest(seed, size)


def _ask(path: Path, op: Op, token: bytes = bytes(16), participant: str = "") -> wire.Reply:
    reply, fds = shimenv.request(
        path, wire.Request(op, participant=participant, authorization=token)
    )
    for fd in fds:
        os.close(fd)
    return reply


# ---------------------------------------------------------------- the lease
def test_lease_rules(spawn: Spawn, shim_env: dict[str, str], control_dir: Path) -> None:
    creator, _, handle, va, _, size = _team(spawn, shim_env, 0)
    path = shimenv.socket_path(control_dir, creator.pid)
    me = shimenv.handshake(path).participant
    first, second = os.urandom(16), os.urandom(16)

    # Nobody holds it: a phase op with a token must take it at HANDSHAKE first.
    refused = _ask(path, Op.PREPARE_MULTICAST, first, me)
    assert refused.status is Status.REFUSED and "HANDSHAKE takes it" in refused.message
    assert _ask(path, Op.HANDSHAKE, first).status is Status.OK  # taken
    assert _ask(path, Op.HANDSHAKE, first).status is Status.OK  # the holder again
    for op in (Op.HANDSHAKE, Op.INSPECT, Op.PREPARE_MULTICAST, Op.RELEASE):
        other = _ask(path, op, second, "" if op in (Op.HANDSHAKE, Op.RELEASE) else me)
        assert other.status is Status.REFUSED, op
        assert f"{HOLDER_NAMED}{os.getpid()}, as this shim sees it, since " in other.message
        unused = "it has sent nothing past HANDSHAKE: another's HANDSHAKE takes the lease once "
        assert f"{unused}SNAPSHOT_LEASE_HANDSHAKE_S (10 s)" in other.message, other.message
        assert other.phase is Phase.ACTIVE
    # Without a token: what only reads is served, what changes is not.
    assert _ask(path, Op.HANDSHAKE).status is Status.OK
    assert _ask(path, Op.INSPECT, participant=me).status is Status.OK
    untokened = _ask(path, Op.PREPARE_MULTICAST, participant=me)
    assert untokened.status is Status.REFUSED and "carries no lease token" in untokened.message
    # RELEASE needs the token; the holder's ends the lease; a second one is harmless.
    assert _ask(path, Op.RELEASE, first).status is Status.OK
    assert _ask(path, Op.RELEASE, first).status is Status.OK
    assert _ask(path, Op.HANDSHAKE, second).status is Status.OK  # free again: taken
    assert _ask(path, Op.RELEASE, second).status is Status.OK
    _intact(creator, [], handle, va, [], size, SEED)


def test_a_lease_whose_holder_never_acts_is_taken_over(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path
) -> None:
    """A HANDSHAKE (and INSPECT) alone holds the lease against another coordinator only
    for SNAPSHOT_LEASE_HANDSHAKE_S; a holder that acted keeps it."""
    env = {**shim_env, "SNAPSHOT_LEASE_HANDSHAKE_S": "0.001"}
    creator, _, handle, va, _, size = _team(spawn, env, 0)
    path = shimenv.socket_path(control_dir, creator.pid)
    me = shimenv.handshake(path).participant
    stray, second, third = os.urandom(16), os.urandom(16), os.urandom(16)
    assert _ask(path, Op.HANDSHAKE, stray).status is Status.OK
    assert _ask(path, Op.INSPECT, stray, me).status is Status.OK  # reads: not acting
    # Taken over once the window (1 ms) has passed since the stray's HANDSHAKE.
    wait_until(lambda: _ask(path, Op.HANDSHAKE, second).status is Status.OK, "a take-over")
    gone = _ask(path, Op.INSPECT, stray, me)
    assert gone.status is Status.REFUSED and "not the holder's" in gone.message
    acted = _ask(path, Op.PREPARE_MULTICAST, second, me)  # a phase op: the holder acts
    assert acted.status is Status.WRONG_PHASE, acted.message
    kept = _ask(path, Op.HANDSHAKE, third)
    assert kept.status is Status.REFUSED and f"{HOLDER_NAMED}{os.getpid()}," in kept.message
    assert "sent nothing past HANDSHAKE" not in kept.message
    assert _ask(path, Op.RELEASE, second).status is Status.OK
    _intact(creator, [], handle, va, [], size, SEED)


def test_a_dead_holders_lease_is_taken_over(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path
) -> None:
    creator, _, handle, va, _, size = _team(spawn, shim_env, 0)
    path = shimenv.socket_path(control_dir, creator.pid)
    token = os.urandom(16)
    # Another process takes the lease, then exits without releasing it.
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.shim.workers.lease_holder", str(path), token.hex()],
        env=coordinator_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdin is not None
    assert holder.stdout.readline().strip() == "OK"  # it holds the lease now
    mine = os.urandom(16)
    alive = _ask(path, Op.HANDSHAKE, mine)
    assert alive.status is Status.REFUSED and f"{HOLDER_NAMED}{holder.pid}," in alive.message
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0
    taken = _ask(path, Op.HANDSHAKE, mine)  # its process is gone: the lease is free
    assert taken.status is Status.OK, taken.message
    assert _ask(path, Op.RELEASE, mine).status is Status.OK
    _intact(creator, [], handle, va, [], size, SEED)


@pytest.mark.slow
@pytest.mark.timeout(300)  # 20 races of two coordinators: about a minute on 2 loaded cores
def test_two_coordinators_racing_prepare_never_wedge_the_group(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    creator, importers, handle, va, vas, size = _team(spawn, shim_env, 1)
    pids = [creator.pid, importers[0].pid]
    outcomes: dict[str, int] = {"one": 0, "none": 0, "holder named": 0}
    for trial in range(20):
        dirs = [tmp_path / f"t{trial}-{side}" for side in "ab"]
        for d in dirs:
            d.mkdir()
        runs: list[object] = [None, None]

        def prepare(k: int, dirs: list[Path] = dirs, runs: list[object] = runs) -> None:
            runs[k] = cli("prepare", pids, control_dir, dirs[k])

        threads = [threading.Thread(target=prepare, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = [r.returncode for r in runs]  # type: ignore[attr-defined]
        texts = [r.stderr for r in runs]  # type: ignore[attr-defined]
        assert sorted(codes) in ([0, 1], [1, 1]), (trial, codes, texts)
        for code, text in zip(codes, texts, strict=True):
            if code == 1:  # refused, naming the holder (or, once the other ended, its phase)
                assert HOLDER_NAMED in text or "PREPARED" in text, (trial, text)
                outcomes["holder named"] += HOLDER_NAMED in text
        if 0 in codes:
            outcomes["one"] += 1
            winner = dirs[codes.index(0)]
            assert (winner / "checkpoint" / "cuinterpose.state").is_file()
            restored = cli("restore", pids, control_dir, winner)
            assert restored.returncode == 0, (trial, restored.stderr)
        else:
            outcomes["none"] += 1
        for w in (creator, *importers):  # ACTIVE again, never wedged
            path = shimenv.socket_path(control_dir, w.pid)
            assert shimenv.handshake(path).phase is Phase.ACTIVE, trial
        _intact(creator, importers, handle, va, vas, size, SEED)
    assert outcomes["one"] + outcomes["none"] == 20
    print(f"racing prepare, 20 trials: {outcomes}")  # shown with -s: how the races fell
    for w in (creator, *importers):
        w.close_clean()


# ---------------------------------------------------------------- whole teams
def test_prepare_refuses_a_team_that_leaves_out_a_live_importer(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    creator, importers, handle, va, vas, size = _team(spawn, shim_env, 2)
    left_out = importers[1]
    left_id = shimenv.handshake(shimenv.socket_path(control_dir, left_out.pid)).participant
    refused = cli("prepare", [creator.pid, importers[0].pid], control_dir, tmp_path)
    assert refused.returncode == 1, refused.stderr
    assert (
        f"the process with pid {left_out.pid} (as this process sees it; participant {left_id}) "
        "imported this allocation and is not among the processes named: name it too"
    ) in refused.stderr
    assert (
        "refused by the check for memory and sharing that cannot be checkpointed, nothing changed"
        in refused.stderr
    )
    assert not (tmp_path / "checkpoint" / "cuinterpose.intent").exists()
    for w in (creator, *importers):
        assert shimenv.handshake(shimenv.socket_path(control_dir, w.pid)).phase is Phase.ACTIVE
    _intact(creator, importers, handle, va, vas, size, SEED)
    # The whole team is captured and restored.
    whole = [creator.pid, *(w.pid for w in importers)]
    assert cli("prepare", whole, control_dir, tmp_path).returncode == 0
    restored = cli("restore", whole, control_dir, tmp_path)
    assert restored.returncode == 0, restored.stderr
    _intact(creator, importers, handle, va, vas, size, SEED)
    for w in (creator, *importers):
        w.close_clean()


# ---------------------------------------------------------------- trusted endpoints
@pytest.mark.parametrize("unsafe", ["mode 0777", "symlink"])
def test_an_untrusted_control_dir_gets_no_socket(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, unsafe: str
) -> None:
    real = control_dir / "r"  # short: a socket path must fit sun_path
    real.mkdir(mode=0o700)
    if unsafe == "mode 0777":
        real.chmod(0o777)
        given, why = real, "is writable by group or others"
    else:
        given, why = control_dir / "l", "is a symbolic link"
        given.symlink_to(real)
    app = spawn("app", {**shim_env, "SNAPSHOT_CONTROL_DIR": str(given)})
    size = 2 * int(app.check("granularity")["granularity"])
    _, va = app.create_mapped(size, seed=SEED)  # tracked: the shim started
    assert app.digest(va, size) == pattern_digest(SEED, size)  # the application runs on
    assert list(real.iterdir()) == []  # nothing served there
    log = (tmp_path / "app.stderr").read_text()
    assert f"control directory {given} {why}" in log and "no control server" in log
    app.close_clean()


def _forged_capability(creator: str, endpoint: str) -> int:
    """A sealed memfd holding a well-formed capability that names ``endpoint``."""
    raw = struct.pack(
        "<IHH32s16s16s40sQIHH",
        0x43495543, 1, 1, creator.encode(), b"\x11" * 16, b"\x22" * 16, endpoint.encode(),
        1 << 21, 1, 0, 0,
    )  # fmt: skip
    fd = os.memfd_create("capability", os.MFD_ALLOW_SEALING)
    os.write(fd, raw)
    seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.skipif(os.getuid() != 0, reason="serving as another uid needs root")
def test_an_import_refuses_a_creator_socket_served_by_another_uid(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    importer = spawn("importer", shim_env)
    importer.create_mapped(2 * int(importer.check("granularity")["granularity"]))  # started
    name = "cuinterpose-999999.sock"
    with served_by_nobody(control_dir / name) as child:
        fd = _forged_capability("ab" * 16, name)
        importer.give_fd(fd)
        os.close(fd)
        theirs = int(importer.check("recv_fd")["fd"])
        answer = importer.call("import", fd=theirs)
        assert "CUDA_ERROR_INVALID_VALUE" in str(answer), answer
    log = (tmp_path / "importer.stderr").read_text()
    assert f"is served by pid {child} of uid {NOBODY}, not root nor uid 0: not trusted" in log
    importer.close_clean()


@pytest.mark.skipif(os.getuid() != 0, reason="a control dir of another owner needs root")
def test_the_shim_serves_only_the_uid_it_trusts(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    # The test hook makes the shim trust uid NOBODY alone: the directory must be
    # NOBODY's, and this test's process (root) is then a stranger to it.
    shimenv.needs_test_hooks("SNAPSHOT_SHIM_TRUST_UID")
    os.chown(control_dir, NOBODY, NOBODY)
    app = spawn("app", {**shim_env, "SNAPSHOT_SHIM_TRUST_UID": str(NOBODY)})
    app.create_mapped(2 * int(app.check("granularity")["granularity"]))  # started
    path = shimenv.socket_path(control_dir, app.pid)
    assert path.exists()  # the directory is trusted: the shim serves there
    assert shimenv.raw_exchange(path, wire.Request(Op.HANDSHAKE).encode()) == b""
    log = (tmp_path / "app.stderr").read_text()
    assert "control connection from uid 0 refused" in log
    app.close_clean()


# ---------------------------------------------------------------- the trust hook
def _app_told_to_trust_nobody(
    spawn: Spawn, build: str, control_dir: Path, sim_namespace: str
) -> tuple[Worker, Path]:
    """A shim of ``build`` on a control dir of this test's own uid, told by the test
    hook to trust NOBODY alone; returns it once it has started (an allocation tracked)."""
    env = shimenv.shim_env(build, control_dir=control_dir, namespace=sim_namespace)
    app = spawn("app", {**env, "SNAPSHOT_SHIM_TRUST_UID": str(NOBODY)})
    app.create_mapped(2 * int(app.check("granularity")["granularity"]))
    return app, shimenv.socket_path(control_dir, app.pid)


def test_the_release_shim_ignores_the_trust_hook(
    spawn: Spawn, stack: None, control_dir: Path, sim_namespace: str, tmp_path: Path
) -> None:
    """The release library (build/, the wheel) has no test hook: told to trust NOBODY
    alone, it keeps trusting root and its own uid (it serves this test on a directory
    of this test's uid) and says the variable is ignored."""
    if shimenv.has_test_hooks("release"):
        pytest.fail("build/ has the test hooks compiled in (CUINTERPOSE_TEST_HOOKS=ON)")
    app, path = _app_told_to_trust_nobody(spawn, "release", control_dir, sim_namespace)
    shimenv.wait_socket(control_dir, app.pid)
    reply = shimenv.raw_exchange(path, wire.Request(Op.HANDSHAKE).encode())
    assert wire.Reply.decode(reply).status is Status.OK, reply
    log = (tmp_path / "app.stderr").read_text()
    assert "SNAPSHOT_SHIM_TRUST_UID is a test hook, not in this build" in log, log
    app.close_clean()


def test_a_test_build_takes_the_trust_hook(
    spawn: Spawn, stack: None, control_dir: Path, sim_namespace: str, tmp_path: Path
) -> None:
    """The counterpart: the suite's build (build-asan/) trusts NOBODY alone, so the
    directory of this test's uid is refused and nothing is served there."""
    shimenv.needs_test_hooks("SNAPSHOT_SHIM_TRUST_UID")
    app, path = _app_told_to_trust_nobody(spawn, shimenv.build_kind(), control_dir, sim_namespace)
    assert not path.exists()
    log = (tmp_path / "app.stderr").read_text()
    assert f"control directory {control_dir} is owned by another user" in log, log
    assert "not in this build" not in log
    app.close_clean()


def test_a_connection_whose_peer_cannot_be_named_is_refused_as_such(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    """getsockopt(SO_PEERCRED) failing (a library preloaded after the shim makes it
    fail): the control server refuses the connection and logs the reason, not a uid
    read from credentials that were never filled in."""
    failing = shimenv.test_program("libpeercred_fail.so")
    env = {**shim_env, "LD_PRELOAD": f"{shim_env['LD_PRELOAD']} {failing}"}
    app = spawn("app", env)
    app.create_mapped(2 * int(app.check("granularity")["granularity"]))  # started
    path = shimenv.wait_socket(control_dir, app.pid)
    assert shimenv.raw_exchange(path, wire.Request(Op.HANDSHAKE).encode()) == b""
    log = (tmp_path / "app.stderr").read_text()
    assert "control connection refused: SO_PEERCRED: Operation not supported" in log, log
    assert "control connection from uid" not in log
    app.close_clean()
