"""JobError: the one exception the launcher raises, a single line saying why and what to do."""

from __future__ import annotations


class JobError(RuntimeError):
    """The job cannot run or its result cannot be published; the message says why and what to do."""
