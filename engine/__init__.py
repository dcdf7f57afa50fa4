"""The cuinterpose engine: the library a checkpoint agent embeds.

It speaks the shims' wire protocol, checks the sharing topology, runs the
capture and restore machines of :mod:`cuinterpose.phases` in lockstep over a
group of processes, writes and reads the state file, and traces and replays
runs. It needs no GPU and no CUDA library: the native checkpoint is the
agent's (or :mod:`cuinterpose.native`'s) part. ``__all__`` is the public API
(``AGENT_API``, then ``STEP_API``: below); everything else may change between releases.
"""

# The names imported here and left out of __all__ stay importable for the command
# line and the tests, which is why they are imported at all.
# ruff: noqa: F401

import logging

from .agent import (
    AgentCallback,
    AgentError,
    AgentEvent,
    CopyProgress,
    DetectionRefused,
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

# A library logs; its user decides where the records go (the CLI: frontends/logs.py).
logging.getLogger("cuinterpose").addHandler(logging.NullHandler())

# The public face, in two parts (specs/architecture.md). An embedding agent needs the
# first: the one-call suspend/resume/status of a group, the manifest, the native calls,
# what they raise and report. The second is for an agent that runs its own native steps
# between the coordinator's machines (what ``cuinterpose prepare`` and ``restore`` do):
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
)
STEP_API = (
    "DEFAULT_PHASE_TIMEOUT_S",
    "STATE_FILE_NAME",
    "CaptureResult",
    "CheckpointState",
    "CoordinatorError",
    "Event",
    "Interrupted",
    "PhaseEvent",
    "ProgressCallback",
    "RecoveryReport",
    "Refused",
    "RestoreResult",
    "RollbackResult",
    "StateFileError",
    "capture",
    "read_state",
    "recover",
    "restore",
    "rollback",
)
__all__ = [*AGENT_API, *STEP_API]
