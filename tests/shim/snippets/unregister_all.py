"""UNREGISTER_ALL of tests/shim/test_content.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.shim.snippets.fill_registrations import REG
    from tests.snippet import check, cu

for p in REG:
    check(cu.cuMemHostUnregister(p))
REG = []
