"""JobError: the one exception the launcher raises, a single line saying why and what to do;
JobRefused, the JobError of a check made before any work (exit 2, as every command's refusal:
prepack/cli_help.py)."""

from __future__ import annotations


class JobError(RuntimeError):
    """The job cannot run or its result cannot be published; the message says why and what to do."""


class JobRefused(JobError):
    """The job was refused before any work: an input, format, tokenizer or tokenized set that the
    checks before the pipeline find unusable (pipelines/launch/prepare_job.py); nothing was read past
    the first records, nothing was written."""
