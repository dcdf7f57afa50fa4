"""The cuinterpose engine: the library a checkpoint agent embeds.

It speaks the shims' wire protocol, checks the sharing topology, runs the
capture and restore machines of :mod:`cuinterpose.phases` in lockstep over a
group of processes, writes and reads the state file, and traces and replays
runs. It needs no GPU and no CUDA library: the native checkpoint is the
agent's (or :mod:`cuinterpose.native_calls`'s) part. ``__all__`` is the public API
(``AGENT_API``, then ``STEP_API``: below); everything else may change between releases.

Each name is imported on first use (``__getattr__``): a command that needs
only a few of the engine's modules does not pay for all of them.
"""

from __future__ import annotations

# ruff: noqa: F401  (the TYPE_CHECKING imports are the public names, read by _origins)
import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

# The names the package offers and where each lives: mypy and ruff read these imports;
# at run time __getattr__ reads the same statements (_origins), so there is one list.
# Those left out of __all__ stay importable for the command line and the tests.
if TYPE_CHECKING:
    from .agent import (
        AgentCallback,
        AgentError,
        AgentEvent,
        CopyProgress,
        DetectionRefused,
        Gpu,
        GpuMap,
        GpuMapRefused,
        Manifest,
        ManifestError,
        Origin,
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
        native_for,
        read_manifest,
        remove_stale_sockets,
        require_natively_running,
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
        PreflightRefused,
        Problem,
        Refused,
        StepFailed,
        TopologyRefused,
        VerificationFailed,
    )
    from .native_checkpoint import (
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
        OpEvent,
        ProgressCallback,
        StagingSummary,
        Transfer,
        human_line,
        json_printer,
    )
    from .recovery import RecoveryReport, recover
    from .released import Released, released
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
    from .serial import to_json
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
    if name not in _PUBLIC_FUNCTION_MODULES:
        # A submodule named as an attribute (engine.agent, `from . import discovery`),
        # as once all were loaded: imported without parsing this file for the public
        # names (_origins), which a command naming only submodules never needs.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    if not _ORIGINS:
        _ORIGINS.update(_origins())
    module = _ORIGINS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# The submodules that share their name with a function the package offers.
_PUBLIC_FUNCTION_MODULES = frozenset({"replay", "released"})


class _Engine(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # The import system binds each submodule on this package. Where a public name
        # is also its module's (replay, released), the public one stays, as an eager
        # `from .replay import replay` had it.
        if isinstance(value, types.ModuleType) and name in _PUBLIC_FUNCTION_MODULES:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Engine

# A library logs; its user decides where the records go (the CLI: frontends/logs.py).
logging.getLogger("cuinterpose").addHandler(logging.NullHandler())

# The public face, in two parts (specs/architecture.md). An embedding agent needs the
# first: the one-call suspend/resume/status of a group, the manifest, the native calls,
# what they raise and report, and ``to_json``, the JSON document of what they report.
# The second is for an agent that runs its own native steps between the coordinator's
# machines (what ``cuinterpose prepare`` and ``restore`` do):
# note that ``restore`` there is the restore machine alone, not the way back from
# ``suspend`` (that is ``resume``, which runs the native restore and unlock first). The
# other names the package imports here (the wire client, traces and replays, the
# progress printers) serve the command line and the tests, and may change.
AGENT_API = (
    "AgentCallback",
    "AgentError",
    "AgentEvent",
    "CopyProgress",
    "CudaBackend",
    "DetectionRefused",
    "DriverMismatch",
    "Gpu",
    "GpuMap",
    "GpuMapRefused",
    "Manifest",
    "ManifestError",
    "NativeBackend",
    "NativeError",
    "NativeGroupError",
    "NativeUnavailableError",
    "Options",
    "Origin",
    "Process",
    "ProcessState",
    "ProcessStatus",
    "ResumeFailed",
    "ResumeResult",
    "StagingSummary",
    "StateRefused",
    "StepEvent",
    "SuspendFailed",
    "SuspendResult",
    "Timing",
    "Where",
    "detect",
    "native_for",
    "read_manifest",
    "remove_stale_sockets",
    "resume",
    "status",
    "suspend",
    "to_json",
)
STEP_API = (
    "DEFAULT_PHASE_TIMEOUT_S",
    "STATE_FILE_NAME",
    "CaptureResult",
    "CheckpointState",
    "CoordinatorError",
    "Event",
    "Interrupted",
    "OpEvent",
    "ProgressCallback",
    "RecoveryReport",
    "Refused",
    "RestoreResult",
    "RollbackResult",
    "StateFileError",
    "capture",
    "read_state",
    "recover",
    "require_natively_running",
    "restore",
    "rollback",
)
__all__ = [*AGENT_API, *STEP_API]
