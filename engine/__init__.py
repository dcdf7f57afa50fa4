"""The cuinterpose engine: the library a checkpoint agent embeds.

It speaks the shims' wire protocol, checks the sharing topology, runs the
capture and restore machines of :mod:`cuinterpose.phases` in lockstep over a
group of processes, writes and reads the state file, and traces and replays
runs. It needs no GPU and no CUDA library: the native checkpoint is the
agent's (or :mod:`cuinterpose.native`'s) part. What is listed here is the
public API; everything else may change between releases.
"""

from .agent import (
    AgentError,
    DetectionRefused,
    Manifest,
    ManifestError,
    ResumeFailed,
    SuspendFailed,
    Where,
    detect,
    read_manifest,
    remove_stale_sockets,
    resume,
    suspend,
)
from .client import (
    BadReply,
    Endpoint,
    ParticipantError,
    ParticipantHangup,
    ParticipantTimeout,
    UntrustedEndpoint,
    call_all,
    control_dir_problem,
    endpoint_for,
)
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
from .native import CudaBackend, NativeBackend, NativeError, NativeGroupError, ProcessState
from .options import DEFAULT_PHASE_TIMEOUT_S, Options, Transport
from .progress import (
    DoneEvent,
    Event,
    FailedEvent,
    PhaseEvent,
    ProgressCallback,
    Transfer,
    human_line,
    json_printer,
)
from .recovery import RecoveryReport, recover
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

__all__ = [
    "DEFAULT_PHASE_TIMEOUT_S",
    "STATE_FILE_NAME",
    "AgentError",
    "BadReply",
    "Bound",
    "CaptureResult",
    "CheckpointDirRefused",
    "CheckpointState",
    "CoordinatorError",
    "CudaBackend",
    "DetectionRefused",
    "Divergence",
    "DoneEvent",
    "Endpoint",
    "Event",
    "FailedEvent",
    "Interrupted",
    "Manifest",
    "ManifestError",
    "NativeBackend",
    "NativeError",
    "NativeGroupError",
    "Options",
    "ParticipantError",
    "ParticipantHangup",
    "ParticipantTimeout",
    "ParticipantsRefused",
    "PhaseEvent",
    "PhaseFailed",
    "PreflightRefused",
    "Problem",
    "ProcessState",
    "ProgressCallback",
    "RecoveryReport",
    "Refused",
    "ReplayReport",
    "RestoreResult",
    "ResumeFailed",
    "RollbackResult",
    "StateFileError",
    "SuspendFailed",
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
    "remove_stale_sockets",
    "replay",
    "replay_file",
    "restore",
    "resume",
    "rollback",
    "run_machine",
    "suspend",
]
