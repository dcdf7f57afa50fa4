"""Whether the files this process sees are its own: its mount namespace is that of the
init of its pid namespace (pid 1 as its own /proc shows it), or one it was told to trust.

A coordinator that entered a pod's mount namespace (``nsenter -t POD -m``) sees the
pod's files at every path, the driver's among them: a ``libcuda.so.1`` mounted over
this installation's simulated driver, or over the system's, passes every file-identity
check made there, and loading it runs the pod's code in the coordinator. So no driver
is loaded from a mount namespace other than init's (specs/detection.md "Driver
trust"). Entered without the pid namespace, its /proc is the pod's, in which this
process has no pid: that is refused too, before anything is read through it.

An agent started in a mount namespace of its own (its own container, the host's pids
shared) names that namespace when it starts, in :data:`TRUST_ENV` (the text of
``readlink /proc/self/ns/mnt``): a namespace entered later is another and is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

TRUST_ENV: Final = "CUINTERPOSE_TRUSTED_MOUNT_NS"
_HOW: Final = (
    "run the coordinator in the host's mount namespace (it reaches a pod's processes "
    "with --proc-root /proc), or, for an agent started in a mount namespace of its own, "
    f"set {TRUST_ENV}=$(readlink /proc/self/ns/mnt) where it starts"
)


def _mount_ids(mountinfo: Path) -> set[str]:
    """The mount IDs of a mountinfo file: each mount belongs to one namespace, so two
    processes share some exactly when they share their mount namespace."""
    return {line.split(maxsplit=1)[0] for line in mountinfo.read_text().splitlines() if line}


def _same_as_init(proc: Path, mine: str) -> bool | str:
    """Whether pid 1 of ``proc`` runs in the mount namespace ``mine``; or why that
    cannot be told."""
    try:
        return os.readlink(proc / "1" / "ns" / "mnt") == mine
    except PermissionError:
        pass  # not ptrace-privileged over pid 1: its mount table says as much
    except OSError as exc:
        return f"{proc}/1/ns/mnt cannot be read ({exc.strerror})"
    try:
        return bool(_mount_ids(proc / "self" / "mountinfo") & _mount_ids(proc / "1" / "mountinfo"))
    except OSError as exc:
        return f"neither {proc}/1/ns/mnt nor {proc}/1/mountinfo can be read ({exc.strerror})"


def foreign(proc: Path = Path("/proc"), environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the files this process sees may be another's, in words that say what to do;
    None when its mount namespace is init's, or the one :data:`TRUST_ENV` names."""
    try:
        self_pid = os.readlink(proc / "self")
    except OSError as exc:
        self_pid = f"unreadable ({exc.strerror})"
    if self_pid != str(os.getpid()):
        return (
            f"this process (pid {os.getpid()}) is not {proc}/self ({self_pid}): its {proc} "
            "is another pid namespace's, as in a mount namespace entered without its pid "
            f"namespace (nsenter -m), whose files are another's; {_HOW}"
        )
    mine = os.readlink(proc / "self" / "ns" / "mnt")
    named = environ.get(TRUST_ENV)
    if named:
        if named == mine:
            return None
        return (
            f"this process runs in mount namespace {mine}, not {named}, the one {TRUST_ENV} "
            f"trusts; {_HOW}"
        )
    same = _same_as_init(proc, mine)
    if same is True:
        return None
    why = "that of pid 1" if same is False else f"known to be pid 1's: {same}"
    return (
        f"this process runs in mount namespace {mine}, not {why}, the init of its pid "
        f"namespace: the files it sees may be another's (a pod's, entered with nsenter -m); "
        f"{_HOW}"
    )
