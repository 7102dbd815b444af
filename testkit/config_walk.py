"""The job's config walk: which project modules `pipelines.launch.job.run` hands the run's
PackConfig to, and from where (benchmarks/config_walk.py prints it; tests/test_one_house.py holds
the job to one entrant per module).

A stop is a call into a project module whose frame holds the config: as an argument or local,
or one or two attributes away (a stage's JobContext, a DoFn's `self.ctx.config`). Its entrant is
the nearest frame below it on the stack that also holds the config, in another module; the
runner's own frames hold none, so a stage's DoFns are entered from the step that runs the graph.
Calls are traced on the launcher's thread and the in-process runner's worker threads.

An entry is a stop's first call from its entrant, or a call back into a module its entrant had
left to enter another (checks before the run and again after it are two entries). The runner
handing a stage its next bundle, or a step calling the helper it is already using, is not.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

PROJECT_PACKAGES = ("pipelines", "prepack", "apps", "loaders", "gcp")


@dataclasses.dataclass(frozen=True)
class Walk:
    stops: tuple[str, ...]
    entries: tuple[tuple[str | None, str], ...] = ()  # (entrant, module), in the order they happen

    @property
    def order(self) -> tuple[str, ...]:
        """The modules in the order the walk first enters them."""
        return tuple(dict.fromkeys(module for _, module in self.entries))

    def entrants(self, module: str) -> tuple[str | None, ...]:
        """Who enters `module`, once per entry."""
        return tuple(entrant for entrant, entered in self.entries if entered == module)

    @property
    def entered_more_than_once(self) -> dict[str, tuple[str | None, ...]]:
        return {m: self.entrants(m) for m in self.order if len(self.entrants(m)) > 1}

    @property
    def returns(self) -> int:
        """Entries whose entrant is not the module entered just before: the walk came back to it."""
        return sum(1 for (entrant, _), (_, previous) in zip(self.entries[1:], self.entries) if entrant != previous)

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
    PackConfig = type(config)  # this checkout's (an older one kept it in pipelines.options)

    stops: list[str] = []
    entries: list[tuple[str | None, str]] = []
    last_entered: dict[str | None, str] = {}  # entrant -> the module it entered last
    root = _root()
    # The tracer sees every Python call of the run (Beam's included): each file's module is
    # resolved once, not with a filesystem walk per call.
    module_of: dict[str, str | None] = {}

    def project_module(filename: str) -> str | None:
        if filename not in module_of:
            module_of[filename] = _project_module(filename, root)
        return module_of[filename]

    # Generator frames seen, kept alive so their ids stay theirs (a walk is of a small run).
    generators: dict[int, object] = {}

    def holds(frame) -> bool:
        return any(_holds_config(v, PackConfig) for v in frame.f_locals.values())

    def entrant(frame) -> tuple[str | None, bool]:
        """The entrant's module, and whether it called this frame itself (not through the runner)."""
        below = frame.f_back
        while below is not None:
            module = project_module(below.f_code.co_filename)
            if module is not None and holds(below):
                return module, below is frame.f_back
            below = below.f_back
        return None, False

    def tracer(frame, event, arg):
        if event != "call":
            return None
        module = project_module(frame.f_code.co_filename)
        if module is None or not holds(frame):
            return None
        if not stops or stops[-1] != module:
            stops.append(module)
        resumed = bool(frame.f_code.co_flags & inspect.CO_GENERATOR) and generators.setdefault(id(frame), frame) is not frame
        if not resumed:
            came_from, direct = entrant(frame)
            # Entered again: a first entry from here, or a call back into a module its entrant had
            # left for another. The runner handing a stage its next bundle is not a new entry.
            if came_from != module and ((came_from, module) not in entries or direct and last_entered.get(came_from) != module):
                entries.append((came_from, module))
            if came_from != module and direct:
                last_entered[came_from] = module
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    threading.settrace(tracer)  # the in-process runner's worker threads: the stages' DoFns
    try:
        run(config, *args, **kwargs)
    finally:
        sys.settrace(previous)
        threading.settrace(None)
    return Walk(tuple(stops), tuple(entries))


def walk_pack(pack_args: list[str]) -> Walk:
    """The walk of one `prepack pack` run with these options, on the in-process runner, into a
    temporary output."""
    from pipelines.launch.job import run
    from pipelines.options import parse_args

    with tempfile.TemporaryDirectory() as out:
        config, beam_args = parse_args([*pack_args, "--output", out, "--no-progress", "--runner=FnApiRunner",
                                        "--direct_running_mode=in_memory", "--direct_num_workers=1"])
        return trace_config(run, config, beam_args)
