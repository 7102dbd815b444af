"""Follow the job's config through the code: which modules `pipelines.launch.job.run` hands it to.

Runs one small pack of the sample data in this process and traces, on the launcher's thread
and the in-process runner's worker threads, every call into a project module whose frame holds
the run's `PackConfig`: as an argument or local, or one or two attributes away (a stage's
JobContext, a DoFn's `self.ctx.config`). Each such call has an entrant: the nearest frame below
it on the stack that also holds the config, in another module (the runner's own frames hold no
config, so a stage's DoFns are entered from the step that runs the graph). Prints:

- entries: each module with the modules that enter it. An entry is a first call from an entrant,
  or a call back into a module the entrant had left for another (checks before the run and again
  after it are two); the runner handing a stage its next bundle, or a step calling the helper it
  is already using, is the same entry. The issue's bar: each module entered once, in the order
  the data flows.
- returns: how often the walk, in first-entry order, comes back to a module it had left in
  order to enter another (an orchestrating step calling its next step).
- the time-order figures recorded before this measure existed, for comparison: stops (the
  modules in call order, consecutive calls within one module counted once, generator
  resumptions and each bundle included), rooms, climbs (stops - rooms) and the stops in job.py.

    PYTHONPATH=$PWD python benchmarks/config_walk.py [--list] [-- PACK_OPTIONS...]

Compare the printed figures before and after a change, on the same commit's sample.
"""

from __future__ import annotations

import argparse
import sys

from testkit.config_walk import walk_pack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every entry and stop in order")
    parser.add_argument("pack_args", nargs="*", help="`prepack pack` options to walk instead of the sample at L512 "
                        "(after --; --output, the in-process runner and --no-progress are added)")
    args = parser.parse_args(argv)
    walk = walk_pack(args.pack_args or ["--sample", "--max-length", "512"])
    if args.list:
        print("entries, in the order the walk first enters each module (entrant -> module):")
        for entrant, module in walk.entries:
            print(f"  {entrant or '(caller)'} -> {module}")
        print("stops, in time order:")
        for i, stop in enumerate(walk.stops, 1):
            print(f"{i:3d} {stop}")
    twice = walk.entered_more_than_once
    print(f"config walk from job.run: {len(set(walk.order))} modules, {len(walk.entries)} entries, "
          f"{len(twice)} module(s) entered more than once"
          + "".join(f"; {m} from {', '.join(e or '(caller)' for e in es)}" for m, es in twice.items())
          + f", {walk.returns} returns")
    print(f"time order: {len(walk.stops)} stops in {walk.rooms} modules, "
          f"{walk.climbs} climbs back to a module already left, "
          f"job.py {walk.visits('pipelines/launch/job.py')} times")
    return 0


if __name__ == "__main__":
    sys.exit(main())
