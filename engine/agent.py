"""The agent API: suspend and resume a group of CUDA processes in one call.

For a checkpoint agent (a node agent that also runs CRIU) that embeds the engine,
and for the CLI's ``suspend``, ``resume`` and ``status``. This module is the API's
face; each concern has its own module:

- :func:`detect` and :func:`remove_stale_sockets` (:mod:`.detection`): the
  fail-closed truth table (specs/detection.md). Control sockets are the only
  evidence.
- :class:`Manifest` (:mod:`.manifest`, ``manifest.json`` in the checkpoint
  directory): the group's opt-in (``requested``) and whether capture completed and
  the state file was written (``prepared``). :func:`resume` is driven by it.
- :func:`suspend` (:mod:`.suspension`): detection, capture (when requested, started
  over when QUIESCE found no quiet point: :mod:`.quiesce`), native lock and
  checkpoint of every process, the manifest. A failure after capture undoes what
  was done (native restore and unlock, then the coordinator restore): the group runs
  as before, and :class:`SuspendFailed` says so with every step.
- :func:`resume` (:mod:`.resumption`): native restore and unlock of every process,
  then the coordinator restore when the manifest says prepared.
- :func:`status` (:mod:`.group_status`): every process's native state and shim phase.

Every step is timed (:class:`Timing`), and every event (the machines' progress, the
bytes copied while SAVE/LOAD run (:mod:`.watch`), each agent step) goes to the
caller's callback and to the ``cuinterpose.agent`` logger (:mod:`.events`).
"""

from __future__ import annotations

from .detection import Detection, DetectionRefused, Group, Where, detect, remove_stale_sockets
from .errors import AgentError
from .events import LOGGER_NAME, AgentCallback, AgentEvent, CopyProgress, StepEvent
from .gpus import Gpu, GpuMap, GpuMapRefused
from .group_status import (
    ProcessStatus,
    StateRefused,
    require_natively_running,
    require_states,
    status,
)
from .manifest import (
    MANIFEST_FILE_NAME,
    Manifest,
    ManifestError,
    Origin,
    Participant,
    Process,
    Timing,
    read_manifest,
    restore_plan,
    write_manifest,
)
from .native_checkpoint import DEFAULT_LOCK_TIMEOUT_MS, NativeError
from .resumption import (
    GpuMove,
    Moved,
    ResumeFailed,
    ResumeResult,
    gpu_pairs,
    lost_members,
    recorded_where,
    resume,
)
from .suspension import SuspendFailed, SuspendResult, native_for, suspend

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_MS",
    "LOGGER_NAME",
    "MANIFEST_FILE_NAME",
    "AgentCallback",
    "AgentError",
    "AgentEvent",
    "CopyProgress",
    "Detection",
    "DetectionRefused",
    "Gpu",
    "GpuMap",
    "GpuMapRefused",
    "GpuMove",
    "Group",
    "Manifest",
    "ManifestError",
    "Moved",
    "NativeError",
    "Origin",
    "Participant",
    "Process",
    "ProcessStatus",
    "ResumeFailed",
    "ResumeResult",
    "StateRefused",
    "StepEvent",
    "SuspendFailed",
    "SuspendResult",
    "Timing",
    "Where",
    "detect",
    "gpu_pairs",
    "lost_members",
    "native_for",
    "read_manifest",
    "recorded_where",
    "remove_stale_sockets",
    "require_natively_running",
    "require_states",
    "restore_plan",
    "resume",
    "status",
    "suspend",
    "write_manifest",
]
