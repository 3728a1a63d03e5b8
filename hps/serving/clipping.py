"""Client-given text echoed in error messages, clipped: a name of 100,000 characters must not
turn a short error into a huge one (gRPC carries the message in a header, whose size is
bounded: past it the client sees ``RESOURCE_EXHAUSTED`` instead of the error)."""

from __future__ import annotations

__all__ = ["ECHO_MAX_CHARS", "clip"]

#: The most characters of a client-given name an error message repeats.
ECHO_MAX_CHARS = 80


def clip(text: str, limit: int = ECHO_MAX_CHARS) -> str:
    """``text`` itself when it has at most ``limit`` characters, else its first ``limit``
    followed by how many characters it had.

    >>> clip("x" * 100, 5)
    'xxxxx…(100 chars)'
    """
    return text if len(text) <= limit else f"{text[:limit]}…({len(text)} chars)"
