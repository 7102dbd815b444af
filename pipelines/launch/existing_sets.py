"""The overwrite rule (prepack/overwrite.py) applied to a run's config, asked once: by `prepack pack`
before Beam is imported, or by the job's first step when no caller has (no Beam here)."""

from __future__ import annotations

from pipelines.configs import PackConfig
from pipelines.launch.errors import JobError
from prepack import overwrite


def existing_sets_refusal(config: PackConfig) -> str | None:
    """The overwrite rule (prepack/overwrite.py) for this run's config: the one-line refusal when
    a set it would write already exists and --overwrite was not given, else None. `prepack pack`
    asks it before Beam is imported; the job asks only when no caller has."""
    return None if config.run.overwrite else overwrite.refuse_existing_sets(config.run.output, config.rows.max_lengths,
                                                                        config.run.write_tokens)


def refuse_existing(config: PackConfig) -> None:
    """Fails with JobError when existing_sets_refusal refuses."""
    message = existing_sets_refusal(config)
    if message:
        raise JobError(message)
