"""The edges a new user met (issue 49) that need no shim, through the installed
``cuinterpose`` command: what ``criu check`` tells a user of the package to install,
and what ``criu restore --gpu-map`` says of where each process went."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from test_criu import fake_criu

BIN = Path(sys.executable).parent


def test_criu_check_names_what_to_install_and_links_the_spec(tmp_path: Path) -> None:
    """No criu anywhere, or one older than 4.0: CRIU 4.0 or later from the distribution
    or built from its source, the spec's address; nothing of the checkout's tools/."""
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUINTERPOSE_CRIU"}
    env["PATH"] = str(bare)  # no criu here, and none in the sbin directories either
    if any(Path(d, "criu").exists() for d in ("/usr/local/sbin", "/usr/sbin", "/sbin")):
        env["CUINTERPOSE_CRIU"] = str(fake_criu(tmp_path / "old", version="3.17"))
    runs = [
        subprocess.run([str(BIN / "cuinterpose"), "criu", "check"], env=env,
                       capture_output=True, text=True, timeout=60, check=False),
        subprocess.run([str(BIN / "cuinterpose"), "criu", "check", "--criu",
                        str(fake_criu(tmp_path / "older", version="3.17"))], env=env,
                       capture_output=True, text=True, timeout=60, check=False),
    ]  # fmt: skip
    for run in runs:
        assert run.returncode == 1, run.stderr
        said = run.stderr
        assert "install CRIU 4.0 or later, from the distribution" in said, said
        assert "built from its source (https://criu.org/Installation)" in said
        assert "specs/criu.md#criu-on-a-machine" in said and "https://" in said
        assert "tools/" not in said and "build_criu" not in said, said
    assert "no criu on PATH" in runs[0].stderr or "at least 4.0" in runs[0].stderr
    assert "CRIU 3.17: at least 4.0 is needed" in runs[1].stderr


def test_criu_restore_onto_other_gpus_says_where_each_process_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``criu restore --gpu-map`` ends as ``resume --gpu-map`` does: which GPU each process
    left and which it runs on, for a person and in its JSON summary (CRIU and the resume
    stood in for: what is checked is what the command says of the resume's result)."""
    from cuinterpose import criu_action
    from cuinterpose.engine import Process, criu
    from cuinterpose.engine.criu import ImageSize, RestoreResult
    from cuinterpose.engine.gpus import Gpu
    from cuinterpose.engine.resumption import GpuMove, Moved, ResumeResult

    was, now = Gpu(0, "GPU-" + "0" * 8 + "-0000-0000-0000-" + "0" * 12), Gpu(1, "GPU-1")
    moved = (Moved(4242, 7, (GpuMove(was, now),)),)

    def restored(*args: object, **kwargs: object) -> RestoreResult:
        resumed = ResumeResult(cast(Any, None), True, (), moved=moved)
        return RestoreResult((Process(4242, 7),), (), ImageSize(0, 0, 0), resumed, ())

    monkeypatch.setattr(criu, "usable_criu", lambda *a: criu.Criu(Path("/criu"), (4, 2)))
    monkeypatch.setattr(criu, "restore", restored)
    argv = ["restore", "--checkpoint-dir", str(tmp_path), "--images-dir", str(tmp_path),
            "--control-dir", str(tmp_path), "--gpu-map", "0=1"]  # fmt: skip
    for mode in ("human", "json"):
        out, err = io.StringIO(), io.StringIO()
        code = criu_action.main([*argv, "--progress", mode], stdout=out, stderr=err)
        assert code == 0, err.getvalue()
        if mode == "human":
            assert f"onto other GPUs: pid 4242 (ns pid 7): left GPU 0 {was.uuid}, runs on " \
                "GPU 1 GPU-1" in out.getvalue(), out.getvalue()  # fmt: skip
        else:
            summary = json.loads(out.getvalue().splitlines()[-1])
            assert summary["gpus_moved"] == [{"pid": 4242, "ns_pid": 7, "gpus": [
                {"left": {"ordinal": 0, "uuid": was.uuid, "name": "", "bytes": 0},
                 "now": {"ordinal": 1, "uuid": "GPU-1", "name": "", "bytes": 0}}]}]  # fmt: skip
