"""Tools for the agent tests (actor.agent.tools): one that works, one that raises, one that
hangs, one that returns garbage."""

from __future__ import annotations

import time


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


def fails(a: int, b: int) -> str:
    """Always raises.

    Args:
        a: ignored
        b: ignored
    """
    raise ValueError(f"fails was called with {a}")


def hangs(a: int, b: int) -> str:
    """Never returns.

    Args:
        a: ignored
        b: ignored
    """
    while True:
        time.sleep(1)


def garbage(a: int, b: int) -> object:
    """Returns an object that is neither text nor JSON.

    Args:
        a: ignored
        b: ignored
    """
    return {1, 2, a}
