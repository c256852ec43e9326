"""Assertion helpers shared by every test folder."""
from __future__ import annotations

from typing import Iterable


def every(items: Iterable) -> bool:
    """``all(items)``, but false when there are no items: an ``all(...)`` over an empty list
    is true and proves nothing (a filter that matched nothing, a run that returned no
    results), so ``assert every(...)`` fails there instead."""
    items = list(items)
    return bool(items) and all(items)
