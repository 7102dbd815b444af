"""Follow the job's config through the code: which modules `pipelines.launch.job.run` hands it to.

Runs one small pack of the sample data in this process and traces, on the launcher's thread
and the in-process runner's worker threads, every call into a project module whose frame holds
the run's `PackConfig`: as an argument or local, or one or two attributes away (a stage's
JobContext, a DoFn's `self.ctx.config`). Prints:

- stops: the modules in call order, consecutive calls within one module counted once;
- rooms: the distinct modules among them;
- climbs back up: stops that return to a module the walk already left (stops - rooms);
- the stops in job.py.

    PYTHONPATH=$PWD python benchmarks/config_walk.py [--list]

The walk is what the issue asks to shrink ("each module is entered once, in the order the data
flows"); compare the printed figures before and after a change, on the same commit's sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

PROJECT_PACKAGES = ("pipelines", "prepack", "apps", "loaders", "gcp")


@dataclasses.dataclass(frozen=True)
class Walk:
    stops: tuple[str, ...]

    @property
    def rooms(self) -> int:
        return len(set(self.stops))

    @property
    def climbs(self) -> int:
        return len(self.stops) - self.rooms

    def visits(self, module: str) -> int:
        return Counter(self.stops)[module]


def _root() -> Path:
    """The checkout the imported code comes from (PYTHONPATH decides), so a copy of an older
    commit is walked with this same script."""
    import pipelines

    return Path(pipelines.__file__).resolve().parents[1]


def _project_module(filename: str, root: Path) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(root)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in PROJECT_PACKAGES else None


def _holds_config(value, config_type) -> bool:
    """The config itself, or an object one attribute away from it (a JobContext's `config`, a
    stage's context): how the config reaches the stages."""
    if isinstance(value, config_type):
        return True
    fields = getattr(value, "__dict__", None)
    if fields is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    return bool(fields) and any(isinstance(v, config_type) or _context_holds(v, config_type) for v in fields.values())


def _context_holds(value, config_type) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and any(
        isinstance(getattr(value, f.name, None), config_type) for f in dataclasses.fields(value))


def trace_config(run, config, *args, **kwargs) -> Walk:
    """Calls run(config, *args, **kwargs) under the tracer and returns the config's walk."""
    from pipelines.configs import PackConfig

    stops: list[str] = []
    root = _root()

    def tracer(frame, event, arg):
        if event != "call":
            return None
        module = _project_module(frame.f_code.co_filename, root)
        if module is None:
            return None
        if any(_holds_config(v, PackConfig) for v in frame.f_locals.values()):
            if not stops or stops[-1] != module:
                stops.append(module)
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    threading.settrace(tracer)  # the in-process runner's worker threads: the stages' DoFns
    try:
        run(config, *args, **kwargs)
    finally:
        sys.settrace(previous)
        threading.settrace(None)
    return Walk(tuple(stops))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every stop in order")
    args = parser.parse_args(argv)
    from pipelines.launch.job import run
    from pipelines.options import parse_args

    with tempfile.TemporaryDirectory() as out:
        config, beam_args = parse_args(["--sample", "--output", out, "--max-length", "512", "--no-progress",
                                        "--runner=FnApiRunner", "--direct_running_mode=in_memory",
                                        "--direct_num_workers=1"])
        walk = trace_config(run, config, beam_args)
    if args.list:
        for i, stop in enumerate(walk.stops, 1):
            print(f"{i:3d} {stop}")
    print(f"config walk from job.run: {len(walk.stops)} stops in {walk.rooms} modules, "
          f"{walk.climbs} climbs back to a module already left, "
          f"job.py {walk.visits('pipelines/launch/job.py')} times")
    return 0


if __name__ == "__main__":
    sys.exit(main())
