"""Fixtures for the engine's tests: fake participants in the control dir (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.engine.wire import socket_name
from cuinterpose.testing import FakeParticipant


@pytest.fixture
def start_fake(control_dir: Path) -> Iterator[Callable[..., FakeParticipant]]:
    """Start a fake at ``<control_dir>/cuinterpose-<pid>.sock``; all are stopped at teardown.

    Teardown re-raises a fake's own failure (FakeParticipantError), so a bug in
    the fake fails the test that used it.
    """
    started: list[FakeParticipant] = []

    def start(pid: int | None = None, **kwargs: Any) -> FakeParticipant:
        pid = pid if pid is not None else 1000 + len(started)
        fake = FakeParticipant(control_dir / socket_name(pid), pid=pid, **kwargs)
        started.append(fake.start())
        return fake

    yield start
    errors = []
    for fake in started:
        try:
            fake.stop()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
