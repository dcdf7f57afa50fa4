"""Where the built C libraries are.

Looked up in this order, nothing compiled at run time:

1. ``CUINTERPOSE_BUILD_DIR``, a CMake build tree (``build/``, ``build-asan/``):
   when set it is the only place looked at, so that a development build (the
   sanitizer build, say) is never silently replaced by another copy;
2. the installed package: ``pip install`` puts ``lib/libcuinterpose.so`` and
   ``lib/sim/libcuda.so.1`` inside ``cuinterpose/``;
3. ``build/`` at the top of a checkout (``make build``), where an editable
   install (``make setup``) gets them, since it compiles nothing itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

SHIM_NAME: Final = "libcuinterpose.so"
SIM_DRIVER_NAME: Final = "libcuda.so.1"
BUILD_DIR_ENV: Final = "CUINTERPOSE_BUILD_DIR"

# In the installed package (CMake's install rules, pyproject.toml's install-dir).
PACKAGE_LIB_DIR: Final = Path(__file__).resolve().parent.parent / "lib"
# In a build tree: where shim_c/CMakeLists.txt and shim_c/sim put them.
_TREE_SHIM: Final = Path("shim_c") / SHIM_NAME
_TREE_SIM: Final = Path("shim_c") / "sim" / SIM_DRIVER_NAME


class ArtifactMissingError(FileNotFoundError):
    """A built library is not where it should be."""


def build_dir() -> Path | None:
    """The build tree ``CUINTERPOSE_BUILD_DIR`` names, or ``None`` when it is unset."""
    override = os.environ.get(BUILD_DIR_ENV)
    return Path(override).resolve() if override else None


def checkout_build_dir() -> Path | None:
    """``build/`` of the checkout this module runs from (an editable install), if it does."""
    top = Path(__file__).resolve().parent.parent
    # Installed, that is the package's own folder: no build tree belongs there.
    if not (top / "shim_c" / "CMakeLists.txt").is_file():
        return None
    return top / "build"


def _find(installed: Path, in_tree: Path, what: str) -> Path:
    override = build_dir()
    if override is not None:
        candidates = [override / in_tree]
    else:
        candidates = [PACKAGE_LIB_DIR / installed]
        checkout = checkout_build_dir()
        if checkout is not None:
            candidates.append(checkout / in_tree)
    for path in candidates:
        if path.is_file():
            return path
    if override is not None:
        hint = f"run `make build` (or unset {BUILD_DIR_ENV})"
    elif len(candidates) > 1:
        hint = "run `make build`"
    else:
        hint = "the installation is incomplete: reinstall cuinterpose"
    raise ArtifactMissingError(f"{what} not found at {' or '.join(map(str, candidates))}: {hint}")


def shim_library() -> Path:
    """Path of ``libcuinterpose.so``."""
    return _find(Path(SHIM_NAME), _TREE_SHIM, "the shim")


def sim_library_dir() -> Path:
    """Directory holding the simulated ``libcuda.so.1``, for the library path."""
    return _find(Path("sim") / SIM_DRIVER_NAME, _TREE_SIM, "the simulated driver").parent


# The checkout's build trees (Makefile): the release build and the sanitizer builds.
_CHECKOUT_TREES: Final = ("build", "build-asan", "build-tsan")


def sim_drivers() -> tuple[Path, ...]:
    """Every simulated ``libcuda.so.1`` of this installation, the one
    :func:`sim_library_dir` finds first: ``CUINTERPOSE_BUILD_DIR``'s, the package's, and
    those of the checkout's build trees (a sanitizer build's shims run on its own)."""
    candidates = []
    override = build_dir()
    if override is not None:
        candidates.append(override / _TREE_SIM)
    candidates.append(PACKAGE_LIB_DIR / "sim" / SIM_DRIVER_NAME)
    checkout = checkout_build_dir()
    if checkout is not None:
        candidates += [checkout.parent / tree / _TREE_SIM for tree in _CHECKOUT_TREES]
    return tuple(dict.fromkeys(p for p in candidates if p.is_file()))
