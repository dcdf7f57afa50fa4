"""The package as a user gets it, away from this checkout.

The sdist is built first and the wheel from the sdist (``pip wheel``), so a
file the build needs but the sdist lacks fails here. The wheel goes into a
throwaway virtual environment (``--no-deps``, its runtime dependencies from the
index), and the installed command runs from a directory outside the checkout
with nothing of the development set-up in its environment: the libraries, the
demo's worker and everything else it needs must come from site-packages.

Needs the package index (pip's build isolation and the dependencies); pip's
cache keeps repeated runs short.
"""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import readme_session

# Builds an sdist, a wheel from it and a virtual environment: minutes, not the default
# per-test timeout (pyproject.toml).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
# Anything that could lead the installed copy back to this checkout or its builds.
SCRUBBED_PREFIXES = ("CUINTERPOSE_", "SNAPSHOT_", "PYTHON", "LD_", "ASAN_", "UBSAN_")
SCRUBBED = {"VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV"}


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


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's own ``Requires-Dist`` lines that no extra guards."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(zf.read(name).decode())
    return [r for r in metadata.get_all("Requires-Dist", []) if "extra ==" not in r]


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

    # No pip of its own: this environment's pip installs into it (--python).
    start = time.monotonic()
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=outside, env=env)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q"]
    run([*pip, *runtime_requirements(wheel)], cwd=outside, env=env)
    run([*pip, "--no-deps", wheel], cwd=outside, env=env)
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
    needed = {"pyproject.toml", "CMakeLists.txt", "README.md", "tests/shim/c/tests.cmake"}
    for pattern in ("*.c", "*.h", "CMakeLists.txt"):
        needed |= {p.relative_to(REPO).as_posix() for p in (REPO / "shim_c").rglob(pattern)}
    for folder in ("frontends", "engine", "phases"):
        needed |= {p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob("*.py")}
    assert "shim_c/protocol.h" in needed
    assert needed <= names, sorted(needed - names)
    built = [n for n in names if n.split("/")[0].startswith(("build", ".venv", "dist"))]
    assert not built, built
    assert not [n for n in names if "__pycache__" in n or n.endswith((".so", ".so.1", ".o"))]


def test_wheel_is_one_per_platform_and_holds_the_libraries(installed: Installed) -> None:
    assert installed.wheel.name.startswith("cuinterpose-0.1.0-py3-none-linux_")
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
    for needed in (
        "cuinterpose/lib/libcuinterpose.so",
        "cuinterpose/lib/sim/libcuda.so.1",
        "cuinterpose/demo/worker.py",
        "cuinterpose/engine/runner.py",
        "cuinterpose/phases/machines.py",
        "cuinterpose/py.typed",
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
    assert installed.cuinterpose("--version").stdout.strip() == f"cuinterpose {version}"


def test_the_readme_session_finds_the_simulated_driver_by_itself(
    installed: Installed, tmp_path: Path
) -> None:
    """README.md's Using it, from the wheel, with nothing on the library path: the
    native checkpoint calls load the driver the launched program's shim reports."""
    assert not [k for k in installed.env if k.startswith("LD_")]
    ran = readme_session.run(tmp_path / "session", installed.venv / "bin", installed.env)
    readme_session.check(ran)
