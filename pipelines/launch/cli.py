"""`prepack pack`: parse options, run the job, print where the shards went and the density table."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from pipelines.faults import failures
from pipelines.configs import PackConfig
from pipelines.launch import interrupts
from pipelines.options import OptionsError, parse_args
from prepack.cli_help import EXIT_FAILED, EXIT_REFUSED

# Local runs: worker processes forward their logs to the runner, which re-logs
# them as warnings ("No semi_persistent_directory found", ...). They are noise here.
_QUIET_LOGGERS = ("apache_beam.runners.portability.local_job_service", "apache_beam.runners.worker")


class _KnownFailureRelays(logging.Filter):
    """Drops the runner's relays of a worker's failure that the launcher states in one line itself
    (a truncated .gz, an input over a limit: pipelines/faults/failures.py). They were 85 lines of worker
    tracebacks before that line; --verbose keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f"\n{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        return not failures.is_known(text)


def _configure_logs(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        for handler in logging.getLogger().handlers:
            if not any(isinstance(f, _KnownFailureRelays) for f in handler.filters):
                handler.addFilter(_KnownFailureRelays())


@contextlib.contextmanager
def _signal_handlers_restored():
    """interrupts.install() is for this run only: an in-process caller (a test, a notebook) gets
    its own SIGINT/SIGTERM handlers back afterwards."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if interrupts.received() is None:  # after a signal, a second one must still end the process at once
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config, beam_args = parse_args(argv)
    except OptionsError as e:
        print(f"prepack pack: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return run_config(config, beam_args)


def run_config(config: PackConfig, beam_args: Sequence[str]) -> int:
    """`prepack pack` from its parsed config: what `main` runs, and `prepack preflight --pack-output`
    with the RowSpec it evaluated. Prints as `prepack pack` does; returns its exit status."""
    from pipelines.faults import failpoints

    try:
        failpoints.check(config.rows.max_lengths, config.run.write_tokens)
    except failpoints.FailpointError as e:
        print(f"prepack pack: {e}", file=sys.stderr)
        return EXIT_REFUSED
    # An existing set without --overwrite is refused first, before Beam is even imported.
    from pipelines.launch.existing_sets import existing_sets_refusal

    refusal = existing_sets_refusal(config)
    if refusal:
        print(f"prepack pack: {refusal}", file=sys.stderr)
        return EXIT_REFUSED  # refused before any work, as every command refuses
    _configure_logs(config.run.verbose)
    from pipelines.launch.job import Interrupted, run
    from pipelines.launch.errors import JobError, JobRefused
    from pipelines.launch.report import density_table, run_line
    from pipelines.launch.worker_stderr import QuietAfterSignal

    try:
        with _signal_handlers_restored():
            interrupts.install()
            with contextlib.nullcontext() if config.run.verbose else QuietAfterSignal():
                result = run(config, beam_args, existing_refused=True)
    except JobRefused as e:  # the checks before the pipeline: nothing read past the first records, nothing written
        print(f"prepack pack: {e}", file=sys.stderr)
        interrupts.exit_if_signalled(EXIT_REFUSED)
        return EXIT_REFUSED
    except JobError as e:
        print(f"prepack pack: {e}", file=sys.stderr)
        interrupts.exit_if_signalled(EXIT_FAILED)  # stopped by a signal (a lost lock): Beam's threads would hold the exit
        return EXIT_FAILED
    except Interrupted as e:
        print(f"prepack pack: {e}", file=sys.stderr)
        interrupts.exit_if_signalled(130)
        return 130
    except KeyboardInterrupt:
        print("prepack pack: interrupted; nothing new was published", file=sys.stderr)
        interrupts.exit_if_signalled(130)
        return 130
    for L, path in sorted(result.manifests.items()):
        print(f"L{L}: {path}")
    if result.tokens_manifest:
        print(f"tokens: {result.tokens_manifest} (for new max lengths: prepack pack --from-tokens "
              f"{result.tokens_manifest.rsplit('/', 1)[0]} --max-length L --output ...)")
    print()
    print(density_table(result.stats, packed=config.rows.pack, segment_cap=config.rows.max_segments_per_row))
    if result.mixtures:  # --mixture: what each source asked for and got, per length
        from prepack.packing.mix_table import mix_table_lines

        for L, mixture in sorted(result.mixtures.items()):
            print()
            print("\n".join(mix_table_lines(mixture, L)))
    examples = next(iter(result.stats.values()))["examples_read"]
    print("\n" + run_line(examples, result.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
