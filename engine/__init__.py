"""The cuinterpose engine: the library a checkpoint agent embeds.

It speaks the shims' wire protocol, checks the sharing topology, runs the
capture and restore machines of :mod:`cuinterpose.phases` in lockstep over a
group of processes, writes and reads the state file, and traces and replays
runs. It needs no GPU and no CUDA library: the native checkpoint is the
agent's (or :mod:`cuinterpose.native`'s) part. What is listed here is the
public API; everything else may change between releases.

Each name is imported on first use (``__getattr__``): a command that needs
only a few of the engine's modules does not pay for all of them.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

# The public names and where each lives: mypy and ruff read these imports; at run
# time __getattr__ reads the same statements (_origins), so there is one list.
if TYPE_CHECKING:
    from .agent import (
        AgentCallback,
        AgentError,
        AgentEvent,
        CopyProgress,
        DetectionRefused,
        Manifest,
        ManifestError,
        Process,
        ProcessStatus,
        ResumeFailed,
        ResumeResult,
        StateRefused,
        StepEvent,
        SuspendFailed,
        SuspendResult,
        Timing,
        Where,
        detect,
        read_manifest,
        remove_stale_sockets,
        resume,
        status,
        suspend,
    )
    from .client import (
        BadReply,
        Endpoint,
        ParticipantError,
        ParticipantGone,
        ParticipantHangup,
        ParticipantTimeout,
        UntrustedEndpoint,
        call_all,
        control_dir_problem,
        endpoint_for,
    )
    from .discovery import DriverMismatch, DriverReport, shim_drivers, shims_in
    from .errors import (
        CheckpointDirRefused,
        CoordinatorError,
        Interrupted,
        ParticipantsRefused,
        PhaseFailed,
        PreflightRefused,
        Problem,
        Refused,
        TopologyRefused,
        VerificationFailed,
    )
    from .native import (
        CudaBackend,
        NativeBackend,
        NativeError,
        NativeGroupError,
        NativeUnavailableError,
        ProcessState,
    )
    from .options import DEFAULT_PHASE_TIMEOUT_S, Options, Transport
    from .progress import (
        DoneEvent,
        Event,
        FailedEvent,
        NativeKept,
        PhaseEvent,
        ProgressCallback,
        StagingSummary,
        Transfer,
        human_line,
        json_printer,
    )
    from .recovery import RecoveryReport, recover
    from .released import Released, released, released_by_suspend
    from .replay import Divergence, ReplayReport, machine_mismatch, replay, replay_file
    from .runner import (
        Bound,
        CaptureResult,
        RestoreResult,
        RollbackResult,
        capture,
        inspect,
        restore,
        rollback,
        run_machine,
    )
    from .statefile import STATE_FILE_NAME, CheckpointState, StateFileError, read_state
    from .topology import Topology
    from .trace import TraceError, TraceRecorder, TraceSink, TraceWriter, read_trace


def _origins() -> dict[str, str]:
    """Each public name -> its module, from the ``if TYPE_CHECKING`` imports above."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name: f"{__name__}.{node.module}"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


_ORIGINS: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    module = None
    if name in __all__:
        if not _ORIGINS:
            _ORIGINS.update(_origins())
        module = _ORIGINS.get(name)
    if module is None:
        # A submodule named as an attribute (engine.agent, `from . import discovery`),
        # as once all were loaded.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Engine(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # The import system binds each submodule on this package. Where a public name
        # is also its module's (replay, released), the public one stays, as an eager
        # `from .replay import replay` had it.
        if isinstance(value, types.ModuleType) and name in __all__ and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Engine

# A library logs; its user decides where the records go (the CLI: frontends/logs.py).
logging.getLogger("cuinterpose").addHandler(logging.NullHandler())

__all__ = [
    "DEFAULT_PHASE_TIMEOUT_S",
    "STATE_FILE_NAME",
    "AgentCallback",
    "AgentError",
    "AgentEvent",
    "BadReply",
    "Bound",
    "CaptureResult",
    "CheckpointDirRefused",
    "CheckpointState",
    "CoordinatorError",
    "CopyProgress",
    "CudaBackend",
    "DetectionRefused",
    "Divergence",
    "DoneEvent",
    "DriverMismatch",
    "DriverReport",
    "Endpoint",
    "Event",
    "FailedEvent",
    "Interrupted",
    "Manifest",
    "ManifestError",
    "NativeBackend",
    "NativeError",
    "NativeGroupError",
    "NativeKept",
    "NativeUnavailableError",
    "Options",
    "ParticipantError",
    "ParticipantGone",
    "ParticipantHangup",
    "ParticipantTimeout",
    "ParticipantsRefused",
    "PhaseEvent",
    "PhaseFailed",
    "PreflightRefused",
    "Problem",
    "Process",
    "ProcessState",
    "ProcessStatus",
    "ProgressCallback",
    "RecoveryReport",
    "Refused",
    "Released",
    "ReplayReport",
    "RestoreResult",
    "ResumeFailed",
    "ResumeResult",
    "RollbackResult",
    "StagingSummary",
    "StateFileError",
    "StateRefused",
    "StepEvent",
    "SuspendFailed",
    "SuspendResult",
    "Timing",
    "Topology",
    "TopologyRefused",
    "TraceError",
    "TraceRecorder",
    "TraceSink",
    "TraceWriter",
    "Transfer",
    "Transport",
    "UntrustedEndpoint",
    "VerificationFailed",
    "Where",
    "call_all",
    "capture",
    "control_dir_problem",
    "detect",
    "endpoint_for",
    "human_line",
    "inspect",
    "json_printer",
    "machine_mismatch",
    "read_manifest",
    "read_state",
    "read_trace",
    "recover",
    "released",
    "released_by_suspend",
    "remove_stale_sockets",
    "replay",
    "replay_file",
    "restore",
    "resume",
    "rollback",
    "run_machine",
    "shim_drivers",
    "shims_in",
    "status",
    "suspend",
]
