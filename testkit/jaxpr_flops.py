"""Matrix-product FLOPs of a traced function, counted from its jaxpr with every loop by its trip count.

The reference the analytic count (train/measurement/flops.py) is tested against: XLA's cost analysis counts a
loop body once, this walk multiplies a scan's body by its length. A `cond` counts its most
expensive branch (blocked attention's tile skip; exact when every tile runs). Pallas kernels are
counted per program and per loop iteration (`kernel_flops`): their grids and run-time loop bounds
are not static. Dead code is removed first, as XLA does.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _subjaxprs(eqn: Any):
    from jax.extend import core as jcore

    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(sub, jcore.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jcore.Jaxpr):
                yield sub


def dot_flops(jaxpr: Any, times: float = 1.0) -> float:
    """2 x multiply-adds of every dot_general, scans x their length, conds by their largest branch."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            total += times * 2 * float(np.prod(eqn.outvars[0].aval.shape)) * float(np.prod([lhs.shape[i] for i in contract]))
        elif name == "scan":
            total += dot_flops(eqn.params["jaxpr"].jaxpr, times * eqn.params["length"])
        elif name == "cond":
            total += max(dot_flops(branch.jaxpr, times) for branch in eqn.params["branches"])
        elif name == "pallas_call":
            continue  # see kernel_flops
        else:
            total += sum(dot_flops(sub, times) for sub in _subjaxprs(eqn))
    return total


def traced_flops(fn: Any, *args: Any) -> float:
    """dot_flops of fn(*args), after dead-code elimination."""
    import jax
    from jax._src.interpreters import partial_eval as pe

    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    live, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return dot_flops(live)


def kernel_flops(fn: Any, *args: Any) -> list[tuple[str, float]]:
    """(name, dot FLOPs of one program's body, each loop body once) of every Pallas kernel fn runs."""
    import jax

    found: list[tuple[str, float]] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
                found.append((str(info).split()[0], dot_flops(eqn.params["jaxpr"])))
            for sub in _subjaxprs(eqn):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
