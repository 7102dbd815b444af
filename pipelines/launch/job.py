"""The packing job, in the order the data flows: prepare (prepare_job: the fail-fast checks and
the workers' context), then under the output lock the pipeline (graph: the Beam graph, one
transform per stage), verify (verify: the accounting identity, bad-record, mixture and stop-token
checks), compose what is published (manifest_compose) and commit (the output layer,
pipelines/output/: every publishing step fenced by the lock). Staging is cleaned on every exit it
can catch (interrupts.py for signals) and failures are one line (failures.py).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
from typing import Any

from pipelines import output
from pipelines.faults import failpoints, failures
from pipelines.configs import PackConfig
from pipelines.launch import graph, interrupts, verify
from pipelines.launch.errors import JobError, JobRefused
from pipelines.launch.manifest_compose import staged_sets
from pipelines.launch.prepare_job import prepare
from prepack.format import layout
from prepack.format.manifest import ManifestError

log = logging.getLogger("prepack.pack")


@dataclasses.dataclass
class JobResult:
    manifests: dict[int, str]  # max length -> manifest path
    stats: dict[int, dict[str, Any]]  # each length's manifest `stats` (LengthStats.to_json)
    seconds: float
    run_id: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # said to the user: leftovers, shard counts
    tokens_manifest: str | None = None  # the tokenized set published with the shard sets
    mixtures: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # --mixture: each length's manifest `mixture`


class Interrupted(KeyboardInterrupt):
    """The run was interrupted (SIGINT/SIGTERM); the message says what is published now."""


def _acquire_lock(config: PackConfig, run_id: str) -> output.OutputLock:
    try:
        return output.OutputLock.acquire(config.run.output, run_id, config.run.lock_expiry_s)
    except (output.LockHeld, output.LockLost) as e:  # LockLost: a lease too short for its round trip
        raise JobError(str(e)) from e
    except Exception as e:  # a missing bucket, a read-only folder: say so before any work
        raise JobError(f"output {config.run.output!r} is not writable ({type(e).__name__}: {e})") from e


def _leftovers(config: PackConfig, run_id: str, held: output.OutputLock) -> list[str]:
    """Reports (or with --clean-stale removes) what earlier killed runs left in the output."""
    found = output.find_leftovers(config.run.output, run_id)
    if not found.paths:
        return []
    if config.run.clean_stale:
        output.remove_leftovers(found, held)
        return [f"removed {found.describe(config.run.output).split(' holds ', 1)[1]}"]
    return [f"{found.describe(config.run.output)}; pass --clean-stale to remove them"]


def run(config: PackConfig, beam_args: list[str], run_id: str | None = None, existing_refused: bool = False) -> JobResult:
    """Prepare, run, verify, commit; raises JobError (the previous sets intact) on failure.
    `existing_refused`: the caller has already applied the overwrite rule (prepack/overwrite.py)
    to this config, as `prepack pack` does before Beam is imported; it is not applied again."""
    started = time.monotonic()
    try:
        job = prepare(config, run_id, existing_refused=existing_refused)
    except JobRefused:
        raise
    except JobError as e:  # every check before the pipeline: a refusal, the job has not started
        raise JobRefused(str(e)) from e
    config = job.config  # --from-tokens: with the token choices of the set
    held = _acquire_lock(config, job.run_id)
    held.on_lost = interrupts.stop_main  # a lease found lost mid-pipeline stops the run at once
    commit: output.Commit | None = None

    def clean_up() -> None:
        output.cleanup_run(config.run.output, config.rows.max_lengths, job.run_id)
        held.release()
        output.storage_for(config.run.output).remove_if_empty(config.run.output)  # a failed first run leaves no folder

    cleanup_key = interrupts.register(clean_up)  # run by the signal watchdog if this thread is stuck
    try:
        failpoints.hit("after_lock")
        held.check()  # a run paused past its lease (a stopped VM, a debugger) learns so before it reads anything
        places = [output.length_place(config.run.output, L) for L in config.rows.max_lengths]
        places += [output.tokens_place(config.run.output)] if config.run.write_tokens else []
        seen = output.look(config.run.output, places, held, keep_published=not config.run.overwrite)
        notes = _leftovers(config, job.run_id, held)
        for note in notes:
            log.warning(note)
        summary, metrics = graph.run_pipeline(job, beam_args)
        stats = verify.verify(config, job.run_id, summary, held)
        notes += verify.shard_notes(config, summary)
        staged = staged_sets(job, summary, stats)
        failpoints.hit("before_publish")
        commit = output.Commit(config.run.output, job.run_id, held, seen, config.run.overwrite)
        _commit(commit, config, staged.lengths, staged.tokens)
        tokens_path = layout.tokens_manifest_path(config.run.output) if staged.tokens else None
        figures = {L: s.to_json() for L, s in stats.items()}
        return JobResult(_lengths_switched(commit), figures, time.monotonic() - started, job.run_id, metrics, notes, tokens_path,
                         staged.mixtures)
    except KeyboardInterrupt as e:
        if held.lost is not None:
            raise JobError(str(held.lost)) from e
        raise Interrupted(_interrupted_message(config, _lengths_switched(commit))) from e
    except output.NotAddable as e:  # `look`: the published lengths changed since the check before any work
        raise JobError(f"{e}; nothing was published") from e
    except output.LockLost as e:  # before the commit (a takeover's rewrite, clean-up, kept dead letters): one line
        raise JobError(str(e)) from e
    except output.SwitchRefused as e:
        raise JobError(f"{e}; the sets now in {config.run.output} are another run's; this run published nothing") from e
    except failpoints.InjectedFault as e:  # after_lock, before_publish: nothing switched yet (the commit's own are caught there)
        raise JobError(failures.injected(str(e))) from e
    except ManifestError as e:  # `look`: a manifest or run record in the output over the size cap, refused unread
        raise JobError(f"{e}; nothing was published. Remove it (it is no set this tool wrote) or choose another --output") from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            if commit is not None and commit.switched:  # the previous sets are not all intact any more: say which are new
                raise JobError(_publish_failed(config, _lengths_switched(commit), e)) from e
            raise JobError(failures.no_space(config.run.output, getattr(e, "filename", None))) from e
        raise
    finally:
        clean_up()
        interrupts.unregister(cleanup_key)


def _lengths_switched(commit: output.Commit | None) -> dict[int, str]:
    switched = commit.switched if commit is not None else {}
    return {int(name[1:]): path for name, path in switched.items() if name.startswith("L")}


def _commit(commit: output.Commit, config: PackConfig, lengths: dict[int, output.StagedSet],
            tokens: output.StagedSet | None) -> None:
    """Publishes through the output layer; every failure becomes one line saying what is published."""
    try:
        commit.publish(lengths, tokens)
    except output.LockLost as e:
        raise JobError(str(e)) from e
    except output.SwitchRefused as e:
        raise JobError(f"{e}; the sets now in {config.run.output} are another run's") from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise
        raise JobError(_publish_failed(config, _lengths_switched(commit), e)) from e
    except Exception as e:  # storage errors while publishing (gs:// 5xx, permissions): say what is published
        raise JobError(_publish_failed(config, _lengths_switched(commit), e)) from e


def _partial(config: PackConfig, switched: dict[int, str]) -> str:
    if not switched or len(switched) == len(config.rows.max_lengths):
        return ""
    rest = [L for L in config.rows.max_lengths if L not in switched]
    return (f" (L{', L'.join(map(str, switched))} already hold{'s' if len(switched) == 1 else ''} this run's set, "
            f"L{', L'.join(map(str, rest))} {'does' if len(rest) == 1 else 'do'} not: {layout.run_record_path(config.run.output)} "
            "does not match them; run again with --overwrite)")


def _publish_failed(config: PackConfig, switched: dict[int, str], error: Exception) -> str:
    head = f"publishing into {config.run.output} failed ({type(error).__name__}: {error})"
    if switched:
        return head + (_partial(config, switched) or "; every length was switched: run again with --overwrite to clean up")
    return head + "; nothing new was published, the previous shard sets are intact. Run again"


def _interrupted_message(config: PackConfig, switched: dict[int, str]) -> str:
    if not switched:
        return "interrupted; nothing new was published, the previous shard sets are intact"
    if len(switched) == len(config.rows.max_lengths):
        return "interrupted after every length was switched to the new sets; run again with --overwrite to finish cleaning up"
    return "interrupted while publishing" + _partial(config, switched)
