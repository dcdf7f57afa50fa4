"""Pods as deployed: the coordinator on the host, the workloads in real pods (their own
pid and mount namespaces, a private control directory each: tests/pods/podenv.py), each
process named by its host pid and its namespace pid (specs/detection.md, "Containers").

Every test ends with the processes running and their bytes checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pods.conftest import MakePod, cli_env, run_cli
from tests.pods.podenv import Pod, PodWorker, only_child
from tests.shim.pair import Pair, running_as_before, share

SEED = 43


def pod_pair(pod: Pod, env: dict[str, str], seed: int = SEED) -> tuple[Pair, list[PodWorker]]:
    """A creator and an importer sharing memory by POSIX FD, both in ``pod``."""
    made: list[PodWorker] = []

    def spawn(name: str, env: dict[str, str]) -> object:
        made.append(pod.spawn(name, env))
        return made[-1].worker

    pair = share(spawn, env, seed)  # type: ignore[arg-type]
    return pair, made


def where(control_dir: Path) -> list[str]:
    return ["--proc-root", "/proc", "--control-dir", str(control_dir)]


def processes(workers: list[PodWorker]) -> list[str]:
    return [word for w in workers for word in w.process_args()]


def test_a_pod_round_trip_from_the_host_resumed_from_a_clean_shell(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path, tmp_path: Path
) -> None:
    pod = make_pod()
    pair, workers = pod_pair(pod, pod_env)
    assert all(w.host != w.ns for w in workers)
    ckpt = tmp_path / "ckpt"
    env = cli_env(pod_control_dir)
    run = run_cli(["suspend", "--checkpoint-dir", str(ckpt), *where(pod_control_dir),
                   *processes(workers)], env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    manifest = json.loads((ckpt / "manifest.json").read_text())
    recorded = {(p["observed_pid"], p["namespace_pid"]) for p in manifest["participants"]}
    assert recorded == {(w.host, w.ns) for w in workers}
    # Run inside the pod's namespaces, where the host pids name nothing: refused, saying so.
    inside = subprocess.run(
        [*pod.enter(), sys.executable, "-m", "cuinterpose", "resume", "--checkpoint-dir",
         str(ckpt)], env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert inside.returncode != 0, inside.stdout + inside.stderr
    assert "this coordinator runs in another pid namespace" in inside.stderr, inside.stderr
    # From a clean shell: no environment but PATH, in /; the manifest says where.
    clean = subprocess.run(
        ["env", "-i", f"PATH={os.environ['PATH']}", sys.executable, "-m", "cuinterpose",
         "resume", "--checkpoint-dir", str(ckpt)],
        cwd="/", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert clean.returncode == 0, clean.stdout + clean.stderr
    running_as_before(pair, write_seed=SEED + 1)


def test_two_pods_with_the_same_namespace_pids_are_kept_apart(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path, tmp_path: Path
) -> None:
    """Same namespace pids, same control directory path, one network namespace: the
    suspend of one pod's pair reaches neither the other pod's shims nor its driver."""
    first, second = make_pod(), make_pod()
    ours, ours_workers = pod_pair(first, pod_env)
    theirs, their_workers = pod_pair(second, pod_env, SEED + 10)
    assert [w.ns for w in ours_workers] == [w.ns for w in their_workers]
    ckpt = tmp_path / "ckpt"
    env = cli_env(pod_control_dir)
    run = run_cli(["suspend", "--checkpoint-dir", str(ckpt), *where(pod_control_dir),
                   *processes(ours_workers)], env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    # The other pod's pair runs on, shares live, while ours is suspended.
    running_as_before(theirs, write_seed=SEED + 11)
    resumed = run_cli(["resume", "--checkpoint-dir", str(ckpt)], env)
    assert resumed.returncode == 0, resumed.stderr
    running_as_before(ours, write_seed=SEED + 1)


def test_a_wrong_pair_and_swapped_pairs_are_refused_before_anything_is_sent(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path, tmp_path: Path
) -> None:
    """The importer's host pid with another process's namespace pid, and the pair's two
    pairs swapped: each refused naming the pid namespace's own pid for that process; a
    process named as if it ran on the host, refused saying how to name it; nothing
    changed (every shim ACTIVE, the group shares its bytes on)."""
    pod = make_pod()
    pair, (creator, importer) = pod_pair(pod, pod_env)
    other = pod.spawn("other", pod_env)
    env = cli_env(pod_control_dir)
    wrong = [
        ["--process", str(importer.host), str(other.ns)],
        ["--process", str(creator.host), str(importer.ns),
         "--process", str(importer.host), str(creator.ns)],
    ]  # fmt: skip
    for named in wrong:
        ckpt = tmp_path / f"ckpt-{len(named)}"
        run = run_cli(["suspend", "--checkpoint-dir", str(ckpt), *where(pod_control_dir),
                       *named], env)  # fmt: skip
        assert run.returncode == 1, run.stdout + run.stderr
        first = int(named[1])
        found = importer.ns if first == importer.host else creator.ns
        assert f"pid {first} (ns pid {named[2]}) is not that pair" in run.stderr, run.stderr
        assert f"process {first} is ns pid {found}" in run.stderr, run.stderr
        assert not (ckpt / "manifest.json").exists()
    # Named as if on the host: by its host pid alone, the namespace pid found is named
    # (and --proc-root); by its pair without --proc-root, its mount namespace is, not
    # "start it with cuinterpose launch".
    common = ["suspend", "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--control-dir", str(pod_control_dir)]  # fmt: skip
    alone = run_cli([*common, "--pid", str(creator.host)], env)
    assert alone.returncode == 1, alone.stdout + alone.stderr
    assert f"pid {creator.host} is ns pid {creator.ns} in its own pid namespace" in alone.stderr
    assert f"--process {creator.host} {creator.ns}" in alone.stderr
    assert "--proc-root /proc" in alone.stderr
    paired = run_cli([*common, *creator.process_args()], env)
    assert paired.returncode == 1, paired.stdout + paired.stderr
    assert "another mount namespace" in paired.stderr, paired.stderr
    assert "cuinterpose launch" not in paired.stderr
    status = run_cli(["status", *where(pod_control_dir), *processes([creator, importer, other]),
                      "--json"], env)  # fmt: skip
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)["processes"]
    assert {(r["native_state"], r["shim_phase"]) for r in rows} == {("RUNNING", "ACTIVE")}
    other.worker.close_clean()
    running_as_before(pair, write_seed=SEED + 1)


def test_a_socket_served_by_another_process_than_the_one_observed_is_refused(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path
) -> None:
    """Past detection, every connection checks the server (SO_PEERCRED, in the
    coordinator's pid namespace) is the observed process: the creator's host pid with
    the importer's socket gets nothing sent."""
    from cuinterpose.engine.client import UntrustedEndpoint, call, endpoint_for
    from cuinterpose.engine.wire import Op, Request

    pod = make_pod()
    pair, (creator, importer) = pod_pair(pod, pod_env)
    wrong = endpoint_for(creator.host, importer.ns, control_dir=pod_control_dir,
                         proc_root=Path("/proc"))  # fmt: skip
    try:
        call(wrong, Request(Op.QUIESCE), timeout=10, expect_participant=None)
    except UntrustedEndpoint as exc:
        assert f"served by pid {importer.host}, not by pid {creator.host}" in str(exc)
    else:
        raise AssertionError("a QUIESCE went to the importer named by the creator's pid")
    right = endpoint_for(importer.host, importer.ns, control_dir=pod_control_dir,
                         proc_root=Path("/proc"))  # fmt: skip
    reply = call(right, Request(Op.STATUS), timeout=10, expect_participant=None)
    assert reply.pid == importer.ns
    running_as_before(pair, write_seed=SEED + 1)


def _victim_and_attacker(
    make_pod: MakePod, env: dict[str, str]
) -> tuple[Pair, list[PodWorker], Pod, PodWorker]:
    """A victim pod's sharing pair and an attacker pod whose one worker has the victim
    creator's namespace pid (both pods have a root of their own, set up alike)."""
    victim_pod, attacker_pod = make_pod(own_root=True), make_pod(own_root=True)
    pair, victims = pod_pair(victim_pod, env)
    attacker = attacker_pod.spawn("attacker", env)
    assert attacker.ns == victims[0].ns, (attacker.ns, victims[0].ns)
    return pair, victims, attacker_pod, attacker


def _victims_untouched(victims: list[PodWorker], pod_control_dir: Path, pair: Pair) -> None:
    status = run_cli(["status", *where(pod_control_dir), *processes(victims), "--json"],
                     cli_env(pod_control_dir))  # fmt: skip
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)["processes"]
    assert {(r["native_state"], r["shim_phase"]) for r in rows} == {("RUNNING", "ACTIVE")}
    running_as_before(pair, write_seed=SEED + 1)


def test_an_intermediate_symlink_never_reaches_another_pod(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path, tmp_path: Path
) -> None:
    """The attacker pod replaces ``/tmp`` (above its control directory) with a symbolic
    link to the victim's ``/proc/<host pid>/root/tmp``: its operator's suspend of its
    own process is refused by name, and the victim's shims never hear of it."""
    pair, victims, attacker_pod, attacker = _victim_and_attacker(make_pod, pod_env)
    victim_root = f"/proc/{victims[0].host}/root/tmp"
    swap = attacker_pod.run(f"import os; os.rename('/tmp', '/tmp.real'); "
                            f"os.symlink({victim_root!r}, '/tmp'); print('done')")  # fmt: skip
    assert swap.communicate(timeout=60)[0].strip() == "done"
    ckpt = tmp_path / "ckpt"
    run = run_cli(["suspend", "--checkpoint-dir", str(ckpt), *where(pod_control_dir),
                   *attacker.process_args()], cli_env(pod_control_dir))  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "symbolic link" in run.stderr, run.stderr
    assert f"pid {attacker.host} (ns pid {attacker.ns})" in run.stderr, run.stderr
    _victims_untouched(victims, pod_control_dir, pair)


_RACE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
ctl = sys.argv[1]
os.symlink(sys.argv[2], ctl + ".link")
print("racing", flush=True)
n = 0
while True:  # renameat2(AT_FDCWD, ctl, AT_FDCWD, ctl.link, RENAME_EXCHANGE)
    if libc.renameat2(-100, ctl.encode(), -100, (ctl + ".link").encode(), 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")
    n += 1
"""

_MEND = """
import ctypes, os
ctl = CTL
if os.path.islink(ctl):
    assert ctypes.CDLL(None).renameat2(-100, ctl.encode(), -100, (ctl + ".link").encode(), 2) == 0
print("mended")
"""


def test_a_control_directory_swapped_with_a_symlink_in_a_loop_never_reaches_another_pod(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path, tmp_path: Path
) -> None:
    """The attacker pod swaps its control directory with a symbolic link to the victim's
    (``renameat2(RENAME_EXCHANGE)`` in a loop) while its operator asks for STATUS 40
    times, each a run of its own (one resolution each), and suspends it: every answer is
    its own shim's or a refusal, never the victim's, whose shims stay ACTIVE."""
    from cuinterpose.engine.client import ParticipantError, call
    from cuinterpose.engine.detection import Where
    from cuinterpose.engine.manifest import Process
    from cuinterpose.engine.wire import Op, Request

    pair, victims, attacker_pod, attacker = _victim_and_attacker(make_pod, pod_env)
    mine = Process(attacker.host, attacker.ns)
    own = call(Where(pod_control_dir, Path("/proc")).endpoint(mine), Request(Op.STATUS),
               timeout=10, expect_participant=None).participant  # fmt: skip
    theirs = f"/proc/{victims[0].host}/root{pod_control_dir}"
    race = subprocess.Popen(
        [*attacker_pod.enter(), sys.executable, "-c", _RACE, str(pod_control_dir), theirs],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert race.stdout is not None and race.stdout.readline().strip() == "racing"
        answered, refused = 0, 0
        for _ in range(40):
            endpoint = Where(pod_control_dir, Path("/proc")).endpoint(mine)
            try:
                reply = call(endpoint, Request(Op.STATUS), timeout=5, expect_participant=None)
            except ParticipantError:
                refused += 1
                continue
            assert reply.participant == own, "a STATUS was answered by another pod's shim"
            answered += 1
        run = run_cli(["suspend", "--checkpoint-dir", str(tmp_path / "ckpt"),
                       *where(pod_control_dir), *attacker.process_args()],
                      cli_env(pod_control_dir))  # fmt: skip
        assert race.poll() is None, "the race stopped"
    finally:  # the racer itself (nsenter's child, in the pod), then nsenter
        with contextlib.suppress(LookupError, OSError):
            os.kill(only_child(race.pid), signal.SIGKILL)
        race.wait(timeout=60)
    # The race stopped wherever it was: the attacker's directory back at its name.
    mend = attacker_pod.run(_MEND.replace("CTL", repr(str(pod_control_dir))))
    assert mend.communicate(timeout=60)[0].strip() == "mended"
    assert answered + refused == 40
    if run.returncode == 0:  # it reached its own shim: bring it back
        back = run_cli(["resume", "--checkpoint-dir", str(tmp_path / "ckpt")],
                       cli_env(pod_control_dir))  # fmt: skip
        assert back.returncode == 0, back.stderr
    else:
        assert run.returncode == 1, run.stdout + run.stderr
    _victims_untouched(victims, pod_control_dir, pair)


_KILLED_SUSPEND = """
import os, signal, sys
from pathlib import Path
from cuinterpose.engine import OpEvent, agent
ckpt, ctl, *pids = sys.argv[1:]
pairs = [(int(pids[i]), int(pids[i + 1])) for i in range(0, len(pids), 2)]
def on_event(event):
    if isinstance(event, OpEvent) and event.phase == "SAVE_ALLOCATIONS":
        os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind
agent.suspend(pairs, Path(ckpt), where=agent.Where(Path(ctl), Path("/proc")), on_event=on_event)
"""


def _suspend_killed_at_save(
    workers: list[PodWorker], pod_control_dir: Path, ckpt: Path
) -> None:
    """The engine's suspend of the pod's processes (the command's), SIGKILLed by itself
    once every shim has saved its allocations (its SAVE_ALLOCATIONS event: the op done
    on every one, and nothing sent since)."""
    pairs = [str(pid) for w in workers for pid in (w.host, w.ns)]
    run = subprocess.run(
        [sys.executable, "-c", _KILLED_SUSPEND, str(ckpt), str(pod_control_dir), *pairs],
        env=cli_env(pod_control_dir), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == -signal.SIGKILL, run.stdout + run.stderr


def test_recover_after_a_coordinator_killed_mid_capture_of_a_pod(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path, tmp_path: Path
) -> None:
    """The interrupted capture's intent records each process's pair: ``recover`` with the
    pairs, and with none (taken from the intent), brings the pod's pair back."""
    pod = make_pod()
    pair, workers = pod_pair(pod, pod_env)
    env = cli_env(pod_control_dir)
    for named in (processes(workers), []):
        ckpt = tmp_path / f"ckpt-{len(named)}"
        _suspend_killed_at_save(workers, pod_control_dir, ckpt)
        intent = json.loads((ckpt / "cuinterpose.intent").read_text())
        assert {(p["observed_pid"], p["pid"]) for p in intent["participants"]} == {
            (w.host, w.ns) for w in workers
        }
        status = run_cli(["status", *where(pod_control_dir), *processes(workers), "--json"],
                         env)  # fmt: skip
        rows = json.loads(status.stdout)["processes"]
        assert {r["shim_phase"] for r in rows} == {"ALLOCATIONS_SAVED"}, rows
        back = run_cli(["recover", "--checkpoint-dir", str(ckpt), *where(pod_control_dir),
                        *named], env)  # fmt: skip
        assert back.returncode == 0, back.stdout + back.stderr
        assert not (ckpt / "cuinterpose.intent").exists()
    running_as_before(pair, write_seed=SEED + 1)


def test_a_pod_of_another_uid_is_trusted_only_when_the_operator_names_it(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path, tmp_path: Path
) -> None:
    """A pod whose programs run as uid 65534 (its control directory theirs): refused by
    default, naming the uid and --trust-uid; with --trust-uid 65534, suspended and
    resumed from the host, bytes checked; --trust-uid of another uid changes nothing."""
    pod = make_pod(own_root=True, run_as=65534)
    pair, workers = pod_pair(pod, pod_env)
    env = cli_env(pod_control_dir)
    ckpt = tmp_path / "ckpt"
    base = ["suspend", "--checkpoint-dir", str(ckpt), *where(pod_control_dir),
            *processes(workers)]  # fmt: skip
    for extra in ([], ["--trust-uid", "4242"]):
        refused = run_cli([*base, *extra], env)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "is owned by uid 65534" in refused.stderr, refused.stderr
        assert "--trust-uid 65534" in refused.stderr, refused.stderr
        assert not (ckpt / "manifest.json").exists()
    done = run_cli([*base, "--trust-uid", "65534"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    back = run_cli(["resume", "--checkpoint-dir", str(ckpt), "--trust-uid", "65534"], env)
    assert back.returncode == 0, back.stdout + back.stderr
    running_as_before(pair, write_seed=SEED + 1)


@pytest.mark.parametrize(
    "kind", [{"net": True}, {"user": True}, {"own_root": True}], ids=["net", "user", "own_root"]
)
def test_a_pod_of_each_kind_round_trips_from_the_host(
    make_pod: MakePod,
    pod_env: dict[str, str],
    pod_control_dir: Path,
    tmp_path: Path,
    kind: dict[str, bool],
) -> None:
    """A pod with a network namespace of its own (the simulated driver's native calls
    reach it from there), a user namespace, or a root of its own: suspended and resumed
    from the host by its pairs, bytes checked."""
    pod = make_pod(**kind)
    pair, workers = pod_pair(pod, pod_env)
    ckpt = tmp_path / "ckpt"
    env = cli_env(pod_control_dir)
    run = run_cli(["suspend", "--checkpoint-dir", str(ckpt), *where(pod_control_dir),
                   *processes(workers)], env)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    back = run_cli(["resume", "--checkpoint-dir", str(ckpt)], env)
    assert back.returncode == 0, back.stdout + back.stderr
    running_as_before(pair, write_seed=SEED + 1)


_RESTORE_THREAD = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
pid = int(sys.argv[2])
lock = (ctypes.c_uint8 * 64)()
ctypes.c_uint32.from_buffer(lock).value = 10000  # timeoutMs
unlock = (ctypes.c_uint8 * 64)()
tid = ctypes.c_int(0)
said = {"lock": lib.cuCheckpointProcessLock(pid, lock)}
said["tid_result"] = lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid))
said["tid"] = tid.value
said["unlock"] = lib.cuCheckpointProcessUnlock(pid, unlock)
print(json.dumps(said))
"""


def test_the_restore_thread_id_is_given_in_the_hosts_numbering(
    make_pod: MakePod, pod_env: dict[str, str], pod_control_dir: Path
) -> None:
    """As the real driver does (specs/records/2026-12-07-h100-pid-namespace.jsonl): asked
    by the host pid of a pod's process, the restore thread's id is one of that process's
    threads as the host numbers them, not its id inside the pod."""
    from cuinterpose.engine import artifacts

    pod = make_pod()
    pair, workers = pod_pair(pod, pod_env)
    host = workers[0].host
    driver = artifacts.sim_library_dir() / "libcuda.so.1"
    asked = subprocess.run(
        [sys.executable, "-c", _RESTORE_THREAD, str(driver), str(host)],
        env=cli_env(pod_control_dir), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    said = json.loads(asked.stdout.strip().splitlines()[-1])
    assert said["lock"] == 0 and said["tid_result"] == 0 and said["unlock"] == 0, said
    assert (Path("/proc") / str(host) / "task" / str(said["tid"])).is_dir(), said
    in_pod = {
        int(line.split()[-1])
        for task in (Path("/proc") / str(host) / "task").iterdir()
        for line in (task / "status").read_text().splitlines()
        if line.startswith("NSpid:")
    }
    assert said["tid"] not in in_pod, f"the tid inside the pod was given: {said}"
    running_as_before(pair, write_seed=SEED + 3)
