"""What a verb did and what comes next, for a person and for the JSON summary: a
suspend's or resume's figures (time, bytes staged, the GPU memory released, the next
command), a prepare's, restore's or recover's.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs

from .engine.serial import shape, to_json
from .outcomes import PROG

if TYPE_CHECKING:
    from .engine import agent
    from .engine.released import Released
    from .invocation import Invocation
    from .phases import MachineSpec


def machine_summary(spec: MachineSpec | None, call: Invocation, result: object) -> dict[str, Any]:
    """What a prepare or restore did and what comes next, as suspend and resume say it:
    the lines for a person, the figures for the JSON summary (recover says its own)."""
    from .engine import runner
    from .engine.recovery import RecoveryReport
    from .engine.released import size

    if spec is None and isinstance(result, RecoveryReport):
        return {"action": result.action, "found": list(result.lines()), "lines": []}
    if spec is None or not isinstance(result, runner.CaptureResult | runner.RestoreResult):
        return {}
    moved = sum(p.transfer.allocation_bytes for p in result.phases if p.transfer is not None)
    n = len(call.group)
    who = f"{n} process{'es' if n != 1 else ''}"
    out: dict[str, Any] = {"seconds": result.elapsed_s, "bytes_staged": moved, "processes": n}
    if isinstance(result, runner.CaptureResult):
        restore = shlex.join(
            [
                PROG,
                "restore",
                "--checkpoint-dir",
                str(call.options.checkpoint_dir),
                *call.where_words(),
            ]
        )
        out["next"] = restore
        out["lines"] = [
            f"captured {who} in {result.elapsed_s:.3f} s: {size(moved)} staged by the shims "
            f"into their processes' host memory and released from the GPU; the state file is "
            f"{result.state_path}",
            "next: the native lock and checkpoint of every process, later their native "
            f"restore and unlock, then: {restore}",
        ]
    else:
        out["lines"] = [
            f"restored {who} in {result.elapsed_s:.3f} s, {size(moved)} loaded back by the "
            "shims: every process runs, its sharing as before",
        ]
    return out


@shape(
    exclude=frozenset({"command", "outcome", "checkpoint_dir"}),
    rename={"next_command": "next", "released": "gpu_memory_released", "moved": "gpus_moved"},
    omit=frozenset({"staging", "released", "moved"}),
    extra={"bytes_in": "released"},
)
@attrs.frozen
class Summary:
    """What a suspend or resume did and what comes next."""

    command: str
    outcome: str
    seconds: float
    bytes_staged: int
    processes: int
    timings: tuple[agent.Timing, ...]
    next_command: str
    checkpoint_dir: Path
    staging: dict[str, Any] | None = None  # the shims' staging figures (engine/agent.py)
    released: Released | None = None  # suspend: the GPU memory it released
    # resume --gpu-map: which GPU each process left and which it runs on now
    moved: tuple[agent.Moved, ...] = ()

    @classmethod
    def of(
        cls, command: str, call: Invocation, done: agent.SuspendResult | agent.ResumeResult
    ) -> Summary:
        staged = sum(t.bytes for t in done.timings if t.step in ("capture", "coordinator_restore"))
        words = [PROG, "resume" if command == "suspend" else "suspend",
                 "--checkpoint-dir", str(call.options.checkpoint_dir),
                 *call.where_words()]  # fmt: skip
        if command == "resume":  # a new suspend names the processes, here the manifest's
            for o, n in call.group:
                words += ["--pid", str(o)] if o == n else ["--process", str(o), str(n)]
        # A suspend's result, told by its command: a resume loads no suspension module.
        freed = cast("agent.SuspendResult", done).released if command == "suspend" else None
        return cls(
            command,
            "suspended" if command == "suspend" else "resumed",
            sum(t.seconds for t in done.timings),
            staged,
            len(call.group),
            done.timings,
            shlex.join(words),
            call.options.checkpoint_dir,
            to_json(done.staging) if done.staging is not None else None,
            freed,
            () if command == "suspend" else cast("agent.ResumeResult", done).moved,
        )

    def lines(self) -> list[str]:
        from .engine.released import size

        who = f"{self.processes} process{'es' if self.processes != 1 else ''}"
        if self.command == "suspend":
            staged = (
                f"{size(self.bytes_staged)} staged by the shims, the rest kept by the native "
                "checkpoint"
                if self.bytes_staged
                else "kept by the native checkpoint"
            )
            lines = [f"suspended {who} in {self.seconds:.3f} s"]
            if self.released is not None:
                lines.append(self.released.human())
            lines += self._kept_lines()
            return [
                *lines,
                f"where the bytes are: in the host memory of each process ({staged}); they "
                f"end with the process unless it is dumped (`{PROG} criu dump`); "
                f"{self.checkpoint_dir} holds only the manifest and the state file",
                "every process is CHECKPOINTED until the resume",
                f"next: {self.next_command}",
            ]
        loaded = f", {size(self.bytes_staged)} loaded back by the shims" if (
            self.bytes_staged) else ""  # fmt: skip
        return [
            f"resumed {who} in {self.seconds:.3f} s{loaded}: every process is RUNNING, "
            "its sharing as before",
            *(f"onto other GPUs: {m.describe()}" for m in self.moved),
        ]

    def _kept_lines(self) -> list[str]:
        """The kept host copies' figures (SNAPSHOT_SHIM_KEEP_HOST_COPY): what SAVE copied and
        what it found unchanged, and why a process's SAVE copied everything."""
        from .engine.released import size

        s = self.staging or {}
        if not s.get("kept"):
            return []
        return [
            f"kept host copies: {size(int(s['bytes_copied']))} copied, "
            f"{size(int(s['bytes_unchanged']))} unchanged since the last cycle",
            *(f"copied everything, {note}" for note in s.get("notes", ())),
        ]

    @property
    def bytes_in(self) -> str:
        """Where a suspend's bytes are (written beside what it released)."""
        return "host memory of each process"
