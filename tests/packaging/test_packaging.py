"""The package as a user gets it, away from this checkout.

The sdist is built first and the wheel from the sdist (``pip wheel``), so a
file the build needs but the sdist lacks fails here. The wheel is a manylinux one
(backend/: auditwheel tags it), and it goes into a throwaway virtual environment
with its runtime dependencies from the index, as a user installs it: binaries
only, with no compiler and no cmake to be found (``CC=false``, and ``cc``, ``gcc``,
``cmake``, ``ninja`` on the PATH that fail), so an install that would compile
anything fails here. The installed command runs from a directory outside the
checkout with nothing of the development set-up in its environment: the
libraries, the demo's worker and everything else it needs must come from
site-packages.

Needs the package index (pip's build isolation and the dependencies); pip's
cache keeps repeated runs short.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import cuinterpose
import pytest

from tests import readme_session

# Builds an sdist, a wheel from it and a virtual environment: minutes, not the default
# per-test timeout (pyproject.toml).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
# Anything that could lead the installed copy back to this checkout or its builds.
SCRUBBED_PREFIXES = ("CUINTERPOSE_", "SNAPSHOT_", "PYTHON", "LD_", "ASAN_", "UBSAN_")
SCRUBBED = {"VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV"}
# What a build would run; each fails where the wheel is installed.
BUILD_TOOLS = ("cc", "gcc", "c++", "g++", "clang", "cmake", "ninja", "make")
MANYLINUX = re.compile(r"manylinux_2_(\d+)_x86_64")


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SCRUBBED and not k.startswith(SCRUBBED_PREFIXES)
    }
    env.update(extra)
    return env


def run(
    argv: Sequence[str | Path], *, cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, (
        f"{' '.join(map(str, argv))} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )
    return result


@dataclass(frozen=True)
class Installed:
    sdist: Path
    wheel: Path
    wheel_log: str  # pip wheel -v: CMake's output
    venv: Path
    site_packages: Path
    outside: Path  # a working directory outside the checkout
    env: dict[str, str]
    timings: dict[str, float]

    def cuinterpose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return run(
            [self.venv / "bin" / "cuinterpose", *args],
            cwd=self.outside,
            env=self.env,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("packaging")
    assert not root.resolve().is_relative_to(REPO)
    dist, outside = root / "dist", root / "elsewhere"
    outside.mkdir()
    env = clean_env()
    timings: dict[str, float] = {}

    start = time.monotonic()
    run([sys.executable, "-m", "build", "--sdist", "--outdir", dist, REPO], cwd=outside, env=env)
    (sdist,) = dist.glob("cuinterpose-*.tar.gz")
    timings["sdist"] = time.monotonic() - start

    start = time.monotonic()
    built = run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", dist, sdist],
        cwd=outside,
        env=env,
        timeout=600,
    )
    (wheel,) = dist.glob("cuinterpose-*.whl")
    timings["wheel"] = time.monotonic() - start

    # No pip of its own: this environment's pip installs into it (--python). Nothing
    # may be built: binaries only, and every compiler and build tool fails.
    start = time.monotonic()
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=outside, env=env)
    python = venv / "bin" / "python"
    no_tools = root / "no-build-tools"
    no_tools.mkdir()
    for tool in BUILD_TOOLS:
        stub = no_tools / tool
        stub.write_text(f"#!/bin/sh\necho '{tool}: no build tools where the wheel installs' >&2\n"
                        "exit 1\n")  # fmt: skip
        stub.chmod(0o755)
    no_compiler = clean_env(
        CC="false", CXX="false", PATH=f"{no_tools}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q"]
    pip += ["--only-binary", ":all:"]
    run([*pip, wheel], cwd=outside, env=no_compiler)
    timings["install"] = time.monotonic() - start

    site = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
        cwd=outside,
        env=env,
    ).stdout.strip()
    run_env = clean_env(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        # Not the machine-wide default /snapshot-control.
        SNAPSHOT_CONTROL_DIR=str(root / "control"),
    )
    yield Installed(
        sdist,
        wheel,
        built.stdout + built.stderr,
        venv,
        Path(site).resolve(),
        outside,
        run_env,
        timings,
    )
    print(f"packaging timings: {timings}")


def test_sdist_holds_the_build_and_nothing_built(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as tf:
        top = installed.sdist.name.removesuffix(".tar.gz")
        names = {Path(m.name).relative_to(top).as_posix() for m in tf.getmembers() if m.isfile()}
    needed = {"pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE",
              "backend/cuinterpose_backend.py", "tests/shim/c/tests.cmake"}  # fmt: skip
    for pattern in ("*.c", "*.h", "CMakeLists.txt"):
        needed |= {p.relative_to(REPO).as_posix() for p in (REPO / "shim_c").rglob(pattern)}
    for folder in ("frontends", "engine", "phases"):
        needed |= {p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob("*.py")}
    assert "shim_c/protocol.h" in needed
    assert needed <= names, sorted(needed - names)
    built = [n for n in names if n.split("/")[0].startswith(("build", ".venv", "dist"))]
    assert not built, built
    assert not [n for n in names if "__pycache__" in n or n.endswith((".so", ".so.1", ".o"))]


def test_wheel_is_manylinux_as_auditwheel_finds_it(installed: Installed) -> None:
    """One wheel for every Python 3 on a glibc Linux, tagged as its symbols allow."""
    name = installed.wheel.name
    prefix = f"cuinterpose-{cuinterpose.__version__}-py3-none-"
    assert name.startswith(prefix) and name.endswith(".whl"), name
    tag = name.removeprefix(prefix).removesuffix(".whl")
    assert MANYLINUX.fullmatch(tag), name
    shown = run(
        [sys.executable, "-m", "auditwheel", "show", installed.wheel],
        cwd=installed.outside,
        env=installed.env,
    )
    text = " ".join((shown.stdout + shown.stderr).split())
    assert f'is consistent with the following platform tag: "{tag}"' in text, text
    # Nothing grafted in: the libraries need glibc only.
    with zipfile.ZipFile(installed.wheel) as zf:
        assert not [n for n in zf.namelist() if ".libs/" in n]


def test_install_built_nothing(installed: Installed) -> None:
    """No build tool came with the dependencies (the stubs would have failed a build)."""
    for tool in BUILD_TOOLS:
        assert not (installed.venv / "bin" / tool).exists(), tool
    dists = run(
        [installed.venv / "bin" / "python", "-c",
         "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'].lower() "
         "for d in m.distributions()))"],
        cwd=installed.outside,
        env=installed.env,
    ).stdout.split()  # fmt: skip
    assert "cuinterpose" in dists
    assert not {"cmake", "ninja", "scikit-build-core"} & set(dists), dists


def test_wheel_holds_the_libraries_and_the_license(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
    for needed in (
        "cuinterpose/lib/libcuinterpose.so",
        "cuinterpose/lib/sim/libcuda.so.1",
        "cuinterpose/demo/worker.py",
        "cuinterpose/engine/runner.py",
        "cuinterpose/phases/machines.py",
        "cuinterpose/py.typed",
        f"cuinterpose-{cuinterpose.__version__}.dist-info/licenses/LICENSE",
    ):
        assert needed in names, needed
    # The suite's C test programs are not the package's.
    assert not [n for n in names if "shim_direct" in n or "collide" in n or "tests/" in n]


def test_cuda_header_is_the_build_requirements(installed: Installed) -> None:
    """Not a CUDA toolkit the build machine happens to have."""
    found = [line for line in installed.wheel_log.splitlines() if "-- cuda.h from " in line]
    assert found and "/site-packages/nvidia/" in found[0], found


def test_paths_are_inside_site_packages(installed: Installed) -> None:
    shim = Path(installed.cuinterpose("shim-path").stdout.strip())
    sim = Path(installed.cuinterpose("sim-path").stdout.strip())
    assert shim.is_relative_to(installed.site_packages) and shim.is_file(), shim
    assert shim.name == "libcuinterpose.so"
    assert sim.is_relative_to(installed.site_packages) and (sim / "libcuda.so.1").is_file(), sim
    # Only the simulated driver, since its directory goes first on the library path.
    assert sorted(p.name for p in sim.iterdir()) == ["libcuda.so.1"]


def test_launch_preloads_the_installed_shim(installed: Installed) -> None:
    shim = installed.cuinterpose("shim-path").stdout.strip()
    result = installed.cuinterpose(
        "launch",
        "--driver",
        "sim",
        "--",
        "python",
        "-c",
        "import os; print(os.environ['LD_PRELOAD'])",
    )
    assert result.stdout.strip() == shim


def test_demo_passes(installed: Installed) -> None:
    result = installed.cuinterpose("demo", timeout=300)
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("PASS: 7 ranges"), result.stdout
    assert any(line.startswith("suspend: ") for line in lines), result.stdout


def test_version_comes_from_the_package_metadata(installed: Installed) -> None:
    version = run(
        [installed.venv / "bin" / "python", "-c",
         "import importlib.metadata as m; print(m.version('cuinterpose'))"],
        cwd=installed.outside,
        env=installed.env,
    ).stdout.strip()  # fmt: skip
    assert version == cuinterpose.__version__  # frontends/__init__.py, the one place
    assert installed.cuinterpose("--version").stdout.strip() == f"cuinterpose {version}"


def test_the_readme_session_finds_the_simulated_driver_by_itself(
    installed: Installed, tmp_path: Path
) -> None:
    """README.md's Using it, from the wheel, with nothing on the library path: the
    native checkpoint calls load the driver the launched program's shim reports."""
    assert not [k for k in installed.env if k.startswith("LD_")]
    ran = readme_session.run(tmp_path / "session", installed.venv / "bin", installed.env)
    readme_session.check(ran)
