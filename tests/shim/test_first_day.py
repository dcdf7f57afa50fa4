"""A user's first day (issue 29) and a member lost while suspended (issue 28 §4), on real
shims, through the installed command from a scratch directory: relative paths and a
plain environment (no ``$SNAPSHOT_CONTROL_DIR``, nothing on the library path; the
simulator's namespace alone keeps the test's memory accounting apart).

The group is the release build's creator/importer pair (tests/shim/agentgroup.py): what
``cuinterpose launch`` gives a user, so that the command loads the driver the shims
report with no sanitizer runtime to bring.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.demo import pattern_digest

from tests import simenv
from tests.shim import shimenv
from tests.shim.agentgroup import Group, build_group
from tests.simenv import Spawn

BIN = Path(sys.executable).parent


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir()
    return path


@pytest.fixture
def plain(stack: None, sim_namespace: str) -> dict[str, str]:
    """A login shell's environment, and the simulator's namespace of the test."""
    env = {k: os.environ[k] for k in ("HOME", "USER", "LANG") if k in os.environ}
    env["PATH"] = f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin"
    env["CUINTERPOSE_SIM_NAMESPACE"] = sim_namespace
    return env


@pytest.fixture
def group(spawn: Spawn, control_dir: Path, sim_namespace: str, plain: dict[str, str]) -> Group:
    if not (simenv.BUILD_DIRS["release"] / "shim_c" / "libcuinterpose.so").is_file():
        pytest.skip("build/ has no shim: run `make build`")
    shim = shimenv.shim_env("release", control_dir=control_dir, namespace=sim_namespace)
    observer = simenv.sim_env("release", namespace=sim_namespace)
    return build_group(spawn, shim, observer)


def cli(
    scratch: Path, env: Mapping[str, str], *args: str, shell: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``cuinterpose ARGS`` (or a printed command line, ``shell``) typed in ``scratch``."""
    argv = ["bash", "-c", shell] if shell is not None else [str(BIN / "cuinterpose"), *args]
    return subprocess.run(
        argv, cwd=scratch, env=dict(env), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip


def summary(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    last = json.loads(run.stdout.splitlines()[-1])
    assert last["event"] == "summary", run.stdout
    return dict(last)


def pids(group: Group, only: list[int] | None = None) -> list[str]:
    return [w for p in (only or group.pids) for w in ("--pid", str(p))]


def states(scratch: Path, env: Mapping[str, str], control_dir: Path, *pid: int) -> set[Any]:
    named = [w for p in pid for w in ("--pid", str(p))]
    run = cli(scratch, env, "status", "--control-dir", str(control_dir), *named, "--json")
    assert run.returncode == 0, run.stderr
    return {(r["native_state"], r["shim_phase"]) for r in json.loads(run.stdout)["processes"]}


def test_resume_from_another_shell_finds_the_group_and_a_wrong_directory_changes_nothing(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    first_shell = {**plain, "SNAPSHOT_CONTROL_DIR": str(control_dir)}
    run = cli(scratch, first_shell, "suspend", "--checkpoint-dir", "ck", *pids(group))
    assert run.returncode == 0, run.stderr
    printed = summary(run)["next"]
    assert printed == f"cuinterpose resume --checkpoint-dir ck --control-dir {control_dir}"
    origin = json.loads((scratch / "ck" / "manifest.json").read_text())["origin"]
    assert origin["control_dir"] == str(control_dir)
    assert origin["driver"].endswith("libcuda.so.1") and len(origin["started"]) == 2
    # A wrong directory: refused before any native step, naming the processes and it.
    wrong = control_dir.parent / "wrong"  # short: a socket path has room for 107 bytes
    run = cli(scratch, plain, "resume", "--checkpoint-dir", "ck", "--control-dir", str(wrong))
    assert run.returncode == 1, run.stderr
    assert "nothing was changed" in run.stderr and f"looked in {wrong}" in run.stderr
    assert all(f"pid {p} (ns pid {p}): no shim answers" in run.stderr for p in group.pids)
    assert summary(run)["outcome"] == "refused"
    assert states(scratch, plain, control_dir, *group.pids) == {("CHECKPOINTED", "PREPARED")}
    # The printed command, typed as printed in a plain shell, brings the group back.
    run = cli(scratch, plain, shell=printed)
    assert run.returncode == 0, run.stderr
    assert group.mismatches() == []
    # Once more, quietly, and from another shell with no flag but the checkpoint dir.
    run = cli(scratch, plain, "suspend", "--checkpoint-dir", "ck2", "--control-dir",
              str(control_dir), *pids(group), "-q")  # fmt: skip
    assert (run.returncode, run.stdout) == (0, ""), run.stderr  # -q: nothing but errors
    run = cli(scratch, plain, "resume", "--checkpoint-dir", "ck2")
    assert run.returncode == 0, run.stderr
    assert summary(run)["outcome"] == "resumed"
    assert group.mismatches() == []
    group.close()


@pytest.mark.parametrize("lost", ["importer", "creator"])
def test_a_member_killed_while_suspended_leaves_the_survivor_running_with_its_bytes(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str], lost: str
) -> None:
    run = cli(scratch, plain, "suspend", "--checkpoint-dir", "ck", "--control-dir",
              str(control_dir), *pids(group))  # fmt: skip
    assert run.returncode == 0, run.stderr
    dead, alive = (group.importer, group.creator) if lost == "importer" else (
        group.creator, group.importer)  # fmt: skip
    dead.kill()  # SIGKILL, as kill -9
    # The survivor alone may be named (or none: the manifest's group).
    named = pids(group, [alive.pid]) if lost == "creator" else []
    run = cli(scratch, plain, "resume", "--checkpoint-dir", "ck", *named)
    # The group cannot come back whole; the survivor does, by this one command.
    assert run.returncode == 3, run.stderr
    assert summary(run)["outcome"] == "a member is gone: the survivors run with the bytes they had"
    assert f"pid {dead.pid} (ns pid {dead.pid}) is gone since the suspend" in run.stderr
    assert "the survivors run" in run.stderr, run.stderr
    assert states(scratch, plain, control_dir, alive.pid) == {("RUNNING", "ACTIVE")}
    size = group.size
    if lost == "importer":
        for label, seed in (("creator_x", Group.SEED_X), ("creator_p", Group.SEED_P)):
            assert alive.digest(group.vas[label], size) == pattern_digest(seed, size), label
    else:  # its own bytes are what it imported: the survivor runs, and says what is lost
        assert "lost" in run.stderr, run.stderr
    # The manifest is done with: the directory takes the next suspend.
    assert json.loads((scratch / "ck" / "manifest.json").read_text())["resumed_at"]
    # The dead one's socket is stale: status says so, and offers to clear it.
    run = cli(scratch, plain, "status", "--control-dir", str(control_dir), "--json")
    clear = f"cuinterpose status --control-dir {control_dir} --clear-stale"
    assert f"pid {dead.pid} is gone" in run.stderr and clear in run.stderr, run.stderr
    run = cli(scratch, plain, shell=clear + " --json")
    assert run.returncode == 0 and "removed the stale socket" in run.stderr, run.stderr
    assert [p["observed_pid"] for p in json.loads(run.stdout)["processes"]] == [alive.pid]
    alive.close_clean()
    group.observer.close_clean()


def test_the_step_by_step_flow_from_the_shell(
    group: Group, control_dir: Path, scratch: Path, plain: dict[str, str]
) -> None:
    where = ["--control-dir", str(control_dir)]
    run = cli(scratch, plain, "prepare", "--checkpoint-dir", "ck", *where, *pids(group))
    assert run.returncode == 0, run.stderr
    printed = summary(run)["next"]
    assert printed == shlex.join(["cuinterpose", "restore", "--checkpoint-dir", "ck", *where])
    for action, state in (("lock", "LOCKED"), ("checkpoint", "CHECKPOINTED"),
                          ("state", "CHECKPOINTED"), ("restore", "LOCKED"),
                          ("unlock", "RUNNING")):  # fmt: skip
        run = cli(scratch, plain, "native", "--action", action, "--checkpoint-dir", "ck", *where)
        assert run.returncode == 0, (action, run.stderr)
        assert set(summary(run)["states"].values()) == {state}, (action, run.stdout)
    run = cli(scratch, plain, shell=printed)
    assert run.returncode == 0, run.stderr
    assert group.mismatches() == []
    # A refused run leaves no directory behind (a pid that is no process's).
    run = cli(scratch, plain, "prepare", "--checkpoint-dir", "ck2", *where, "--pid", "999999")
    assert run.returncode == 1 and "does not exist" in run.stderr, run.stderr
    assert not (scratch / "ck2").exists()
    # An embedder's own process, with nothing set: README's example, ``native`` left to
    # its default (the driver the shims report), the same group.
    text = (simenv.REPO / "README.md").read_text()
    match = re.search(r"<!-- embedding example -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md has no embedding example"
    agent = match[1] + textwrap.dedent(
        f"""
        import sys
        took = suspend_and_resume({group.processes!r}, "ck3", {str(control_dir)!r})
        sys.stderr.write(f"steps {{sorted(took)}}\\n")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", agent], cwd=scratch, env=plain, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "'native_checkpoint'" in run.stderr and "'capture'" in run.stderr, run.stderr
    assert group.mismatches() == []
    group.close()
