"""``prepare``, ``restore`` and ``recover``: one machine run (or a recovery) against the
group, after the checks that refuse it with nothing changed (a shim that does not answer,
a process not natively RUNNING), said once with its outcome.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from . import running, summaries
from .arguments import EXIT_OK, UsageError, step_timeout
from .outcomes import PROG, Outcome, say

if TYPE_CHECKING:
    from .engine.client import Endpoint
    from .engine.errors import CoordinatorError
    from .invocation import Invocation
    from .phases import MachineSpec


def run_machine(
    spec: MachineSpec | None, call: Invocation, stdout: TextIO, stderr: TextIO
) -> Outcome:
    """Run ``spec``'s machine, or ``recover`` (None): how it ended, with (JSON progress) a
    last summary line with the outcome and the exit code, as suspend's."""
    from .engine.errors import Refused

    code, result, failure = _machine(spec, call, stdout, stderr)
    said = summaries.machine_summary(spec, call, result) if code == EXIT_OK else {}
    lines = said.pop("lines", [])
    outcome = "refused" if isinstance(failure, Refused) else running.outcome(failure, code)
    return Outcome(code, outcome, figures=said, human=lines, failure=failure)


Ran = tuple[int, object, "CoordinatorError | None"]  # the exit code, the result, the failure


def _machine(spec: MachineSpec | None, call: Invocation, stdout: TextIO, stderr: TextIO) -> Ran:
    from .engine import discovery, runner
    from .engine.detection import Group, look, problems
    from .engine.errors import CoordinatorError
    from .engine.gpus import GpuMapRefused, uuid_pairs
    from .engine.quiesce import until_quiet
    from .engine.recovery import recover
    from .engine.trace import TraceWriter
    from .phases import CAPTURE

    if spec is not None and (gone := running.interrupted_capture(call)):
        return say(gone, stderr), None, None
    endpoints = call.endpoints()
    timeout = step_timeout(call.options.step_timeout)
    if spec is not None:  # recover reports and leaves out the processes that are gone
        # The machine needs every shim: what is at each socket, as detection says it.
        wrong = problems(look(Group(call.group), call.where(), heal=True), True, call.where())
        if wrong:
            return say([f"{call.command} refused:", *wrong], stderr), None, None
    living = [e for e in endpoints if discovery.pid_exists(e.observed_pid, call.proc_root)]
    silent = discovery.unanswered(living, timeout=min(timeout, 10.0))
    if silent:
        listed = call.status_command()
        way = f"give the directory its shims serve in (--control-dir); `{listed}` lists them"
        lines = [f"{call.command} refused, nothing was changed: a shim does not answer",
                 *silent.values(), way]  # fmt: skip
        return say(lines, stderr), None, None
    checkpoint_dir: Path = call.options.checkpoint_dir
    if spec is CAPTURE:
        try:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return (
                say([f"cannot create checkpoint directory {checkpoint_dir}: {exc}"], stderr),
                None,
                None,
            )
    writer = None
    if call.options.trace is not None:
        try:
            writer = TraceWriter(call.options.trace)
        except OSError as exc:
            raise UsageError(
                f"{PROG}: error: cannot write trace {call.options.trace}: {exc}"
            ) from None
    refusal = (
        _native_check(spec, call, endpoints, stderr)
        if spec is not None
        else _recover_native_check(call, endpoints, stderr)
    )
    if refusal is not None:
        return refusal, None, None
    stop = threading.Event()
    where_now = running.Whereabouts(
        running.progress(call.mode, stdout),
        undone=not call.options.no_rollback,
        machine=spec.name if spec is not None else "",
    )
    options = runner.Options(
        phase_timeout=timeout,
        on_progress=where_now,
        trace=writer,
        replace=bool(getattr(call.options, "replace", False)),
        stop=stop,
        rollback_on_failure=not call.options.no_rollback,
    )
    try:
        with running.stopping_on_signals(stop, lambda: where_now.acknowledge(stderr)):
            pairs = (
                uuid_pairs(call.options.gpu_map) if getattr(call.options, "gpu_map", None) else ()
            )
            if spec is None:
                report = recover(endpoints, checkpoint_dir, options, gpu_pairs=pairs)
                if call.mode != "json" and not call.options.quiet:  # what it did: said unless -q
                    with contextlib.suppress(OSError):
                        stdout.write("".join(line + "\n" for line in report.lines()))
                ran: object = report
                result: object = report.result
            elif spec is CAPTURE:  # started over when not quiet, as suspend's capture is
                attempt = functools.partial(runner.capture, endpoints, checkpoint_dir, options)
                result = until_quiet(attempt, options)
            elif pairs:
                result = runner.restore(endpoints, checkpoint_dir, options, gpu_pairs=pairs)
            else:
                result = runner.run_machine(spec, endpoints, checkpoint_dir, options)
            if spec is not None:
                ran = result
        warnings = list(getattr(result, "warnings", ()))
        if spec is None:
            warnings += _suspend_done(checkpoint_dir)
        for warning in warnings:
            stderr.write(f"{PROG}: note: {warning}\n")
    except GpuMapRefused as refused:
        return say(list(refused.lines()), stderr), None, None
    except CoordinatorError as error:
        return running.failure(error, call, stderr), None, error
    except ValueError as exc:
        raise UsageError(f"{PROG}: error: {exc}") from None
    finally:
        if writer is not None:
            writer.close()
    return EXIT_OK, ran, None


def _suspend_done(checkpoint_dir: Path) -> tuple[str, ...]:
    """Once recover brought the group back, a suspend of it that was never resumed (it
    stopped midway, or recover undid it) is over: its manifest is marked resumed, so
    that the directory takes the next suspend. The late steps' lines, if any."""
    from .engine.manifest import MANIFEST_FILE_NAME, ManifestError, read_manifest
    from .engine.resumption import mark_resumed

    if not (checkpoint_dir / MANIFEST_FILE_NAME).is_file():
        return ()
    try:
        manifest = read_manifest(checkpoint_dir)
    except ManifestError:
        return ()
    if manifest.resumed_at:
        return ()
    return (*_capture_done(checkpoint_dir), *mark_resumed(checkpoint_dir, manifest,
                                                          from_images=False))  # fmt: skip


def _capture_done(checkpoint_dir: Path) -> tuple[str, ...]:
    """The suspend's capture, rolled back by recover, is done with: its state file is
    marked restored (as a resume's restore marks it), so that the next suspend's capture
    takes the directory."""
    from .engine.directory import mark_restored
    from .engine.statefile import STATE_FILE_NAME, StateFileError, read_state

    if not (checkpoint_dir / STATE_FILE_NAME).is_file():
        return ()
    try:
        mark_restored(checkpoint_dir, read_state(checkpoint_dir))
    except (StateFileError, OSError) as exc:
        return (f"the group runs, but its capture could not be marked done ({exc}): the next "
                f"suspend into {checkpoint_dir} needs another directory",)  # fmt: skip
    return ()


def _native_check(
    spec: MachineSpec, call: Invocation, endpoints: Sequence[Endpoint], stderr: TextIO
) -> int | None:
    """prepare and restore need every process natively RUNNING (the engine's policy,
    group_status.require_natively_running): refused with exit 1, nothing changed; no
    driver to ask, refused too unless --skip-native-check."""
    from .engine.group_status import StateRefused, require_natively_running
    from .engine.native_checkpoint import NativeUnavailableError
    from .engine.recovery import native_check_refusal

    words = [PROG, "resume", "--checkpoint-dir", str(call.options.checkpoint_dir)]
    resume = f"`{shlex.join([*words, *call.where_words()])}`"
    pairs = [(e.observed_pid, e.namespace_pid) for e in endpoints]
    try:
        require_natively_running(spec.name, call.native(), pairs, call.options.checkpoint_dir,
                                 resume=resume)  # fmt: skip
    except NativeUnavailableError as exc:
        if not call.options.skip_native_check:
            return say(native_check_refusal(call.command, exc), stderr)
        stderr.write(f"{PROG}: note: the native state was not checked (--skip-native-check): "
                     f"{exc}\n")  # fmt: skip
    except StateRefused as refused:
        return say(refused.lines(), stderr)
    return None


def _recover_native_check(
    call: Invocation, endpoints: Sequence[Endpoint], stderr: TextIO
) -> int | None:
    """recover takes any mix of native states back itself (the native restore of a
    CHECKPOINTED process, the unlock of a LOCKED one: a suspend or resume stopped
    between its native steps), said on stderr; a process still held after it fails the
    recover (exit 4). No driver to ask: refused, unless --skip-native-check."""
    from .arguments import EXIT_NEEDS_RECOVER
    from .engine.native_checkpoint import NativeUnavailableError
    from .engine.recovery import NativeStuck, native_back, native_check_refusal

    try:
        done = native_back(call.native(), endpoints)
    except NativeUnavailableError as exc:
        if not call.options.skip_native_check:
            return say(native_check_refusal("recover", exc), stderr)
        stderr.write(f"{PROG}: note: the native state was not checked (--skip-native-check): "
                     f"{exc}\n")  # fmt: skip
        return None
    except NativeStuck as stuck:
        say(["recover failed: a process is still natively held", *stuck.lines,
             "bring it back natively (`cuinterpose native --action restore`, then "
             f"`--action unlock`), then run again: {call.recover_command()}"], stderr)  # fmt: skip
        return EXIT_NEEDS_RECOVER
    say(done, stderr)
    return None
