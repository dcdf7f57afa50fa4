"""REFILL of tests/shim/test_content.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.shim.snippets.worker_setup import fill

    A = ...  # set by the test before this snippet

A = [(h, va, size, s + 1000) for h, va, size, s in A]
for h, va, size, s in A:
    fill(va, size, s)
