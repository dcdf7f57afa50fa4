"""Real pods for the suite: pid and mount namespaces made with util-linux ``unshare``.

A :class:`Pod` is what a container runtime makes of a workload, as far as cuinterpose
sees it: its own pid namespace (its processes have other pids there than on the host),
its own mount namespace with ``/proc`` of that pid namespace and a private 0700 tmpfs on
its control directory (the same path in every pod, holding that pod's sockets only),
optionally a user namespace (``--user --map-root-user``) and a root of its own
(``pivot_root`` onto a tmpfs holding bind mounts of what its programs need, the control
directory a 0700 directory of that tmpfs, which the pod may rename). The
coordinator stays on the host, as the checkpoint agent does, and names each process by
its host pid and its namespace pid (``--proc-root /proc --process H N``).

Workers (the demo's worker application, :class:`cuinterpose.demo.Worker`) enter a pod
through ``nsenter``: a :class:`PodWorker` knows both of its pids. Making pods needs
root (``CAP_SYS_ADMIN``) and ``unshare``/``nsenter``: :func:`unavailable` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import attrs
from cuinterpose.demo import Worker

from tests import simenv

REPO = simenv.REPO
# What a pod with a root of its own binds in from the host: the programs, the libraries,
# the repository (the package, its built shim and simulated driver) and the Python the
# suite runs on.
_ROOT_BINDS = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", "/dev", "/opt")


def unavailable() -> str | None:
    """Why pods cannot be made here, or None."""
    if os.geteuid() != 0:
        return "real pods need root (unshare and mount: CAP_SYS_ADMIN); CI runs as root"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"real pods need util-linux {tool}, not found on PATH"
    probe = subprocess.run(
        ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "true"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"unshare --pid --mount cannot make a pod here: {probe.stderr.strip()}"
    return None


def nspid_chain(host_pid: int) -> tuple[int, ...]:
    """The NSpid line of ``/proc/<host_pid>/status``: the pid in each pid namespace,
    the host's first, the process's own last."""
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return tuple(int(word) for word in line.split()[1:])
    raise LookupError(f"/proc/{host_pid}/status has no NSpid line")


def only_child(pid: int) -> int:
    """The one child of ``pid`` (nsenter's program, unshare's pod init)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(kids) != 1:
        raise LookupError(f"pid {pid} has children {kids}, expected one")
    return int(kids[0])


@attrs.frozen
class PodWorker:
    """A worker in a pod, by both of its pids."""

    worker: Worker
    host: int  # its pid on the host (the coordinator's pid namespace)
    ns: int  # its pid in the pod

    def process_args(self) -> list[str]:
        return ["--process", str(self.host), str(self.ns)]


class Pod:
    """One pod: ``unshare`` holding a pid namespace whose pid 1 sleeps, a mount
    namespace with the pod's control directory on a private tmpfs. Closed (its pid 1
    killed, every process in it with it) by :meth:`close`."""

    def __init__(
        self,
        control_dir: Path,
        scratch: Path,
        *,
        user: bool = False,
        own_root: bool = False,
        net: bool = False,
        run_as: int | None = None,
    ) -> None:
        """``run_as``: the uid (and gid) its programs run as and its control directory
        belongs to (a pod's non-root user); needs ``own_root`` (its bind mounts are
        reached through directories of its own tmpfs, not through the host's /root)."""
        if run_as is not None and not own_root:
            raise ValueError("a pod with run_as needs own_root")
        self.run_as = run_as
        self.control_dir = Path(control_dir)
        self.scratch = Path(scratch)
        self.user = user
        self.own_root = own_root
        self.workers: list[PodWorker] = []
        flags = ["--pid", "--mount", "--fork", "--kill-child"]
        flags += ["--user", "--map-root-user"] if user else []
        flags += ["--net"] if net else []
        flags += [] if own_root else ["--mount-proc"]
        self.unshare = subprocess.Popen(
            ["unshare", *flags, "sh", "-euc", self._init_script()],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert self.unshare.stdout is not None
        said = self.unshare.stdout.read(3)
        if said != b"ok\n":
            self.unshare.kill()
            _, err = self.unshare.communicate(timeout=30)
            raise RuntimeError(f"the pod did not start: {err.decode(errors='replace')}")
        self.init = only_child(self.unshare.pid)  # the pod's pid 1, by its host pid

    def _init_script(self) -> str:
        ctl = shlex.quote(str(self.control_dir))
        private = f"mount -t tmpfs -o mode=0700 pod-control {ctl}"
        if not self.own_root:
            return f"{private}; echo ok; exec sleep infinity >/dev/null"
        root = Path(tempfile.mkdtemp(prefix="root-", dir=self.scratch))
        lines = [f"mount -t tmpfs -o mode=0755 pod-root {root}"]
        for path in (*_ROOT_BINDS, str(REPO), sys.prefix, sys.base_prefix):
            if Path(path).exists():
                q = shlex.quote(str(root) + path)
                lines.append(f"mkdir -p {q} && mount --rbind {shlex.quote(path)} {q}")
        inner = shlex.quote(str(root) + str(self.control_dir))
        # The control directory is a 0700 directory of the root's own tmpfs, not a mount
        # point: the pod may rename it, or any directory above it.
        lines += [
            f"mkdir -p {inner} {root}/proc {root}/old {root}/tmp && chmod 0700 {inner}",
            f"chown {self.run_as}:{self.run_as} {inner}" if self.run_as is not None else "true",
            f"cd {root} && pivot_root . old && mount -t proc proc /proc",
            "umount -l /old && rmdir /old && cd /",
            "echo ok; exec sleep infinity >/dev/null",
        ]
        return " && ".join(lines[:-1]) + " && " + lines[-1]

    # -- processes ----------------------------------------------------------

    def enter(self) -> list[str]:
        """The argv prefix that runs a program in this pod (as its user)."""
        ns = ["-p", "-m"] + (["-U", "--preserve-credentials"] if self.user else [])
        enter = ["nsenter", "-t", str(self.init), *ns, "--root", "--wd=/", "--"]
        if self.run_as is not None:
            uid = str(self.run_as)
            enter += ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--"]
        return enter

    def run(self, code: str) -> subprocess.Popen[str]:
        """Python ``code`` run in this pod (as its user), its stdout a pipe."""
        return subprocess.Popen([*self.enter(), sys.executable, "-c", code],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip

    def spawn(self, name: str, env: Mapping[str, str], **kwargs: object) -> PodWorker:
        """A worker in this pod on ``env``; nsenter and ``env`` run without its preload."""
        env = dict(env)
        preload = env.pop("LD_PRELOAD", "")
        wrapper = self.scratch / f"enter-{self.init}-{name}"
        command = [*self.enter(), "/usr/bin/env", f"LD_PRELOAD={preload}", sys.executable]
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.join(command)} \"$@\"\n")
        wrapper.chmod(0o755)
        worker = Worker(name, env, python=str(wrapper), log_dir=self.scratch, **kwargs)  # type: ignore[arg-type]
        host = only_child(worker.proc.pid)
        pod_worker = PodWorker(worker, host, worker.pid)
        chain = nspid_chain(host)
        if chain[-1] != worker.pid or len(chain) < 2:
            raise RuntimeError(f"{name}: NSpid {chain} does not end with its pid {worker.pid}")
        self.workers.append(pod_worker)
        return pod_worker

    def pid_namespace(self) -> int:
        return os.stat(f"/proc/{self.init}/ns/pid").st_ino

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):
                w.worker.kill()
        if self.unshare.poll() is None:
            self.unshare.kill()  # --kill-child: the pod's pid 1 goes, and the pod with it
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.unshare.communicate(timeout=30)


@contextlib.contextmanager
def pods(
    count: int, control_dir: Path, scratch: Path, **kwargs: bool
) -> Iterator[Sequence[Pod]]:
    made: list[Pod] = []
    try:
        for _ in range(count):
            made.append(Pod(control_dir, scratch, **kwargs))
        yield made
    finally:
        for pod in made:
            pod.close()
