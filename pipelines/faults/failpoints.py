"""Named failpoints (PREPACK_FAILPOINTS), as the pipeline has always imported them.

The mechanism lives in the core, prepack/storage/failpoints.py, since the core's own writers
(prepack/storage/own_files.py) mark steps too and the core imports nothing above it; this
module is its name for the pipeline.
"""

from __future__ import annotations

from prepack.storage.failpoints import (DETAILS, ENV, POINTS, Action, FailpointError, InjectedFault, check, configured, hit,
                                parse)

__all__ = ["DETAILS", "ENV", "POINTS", "Action", "FailpointError", "InjectedFault", "check", "configured", "hit", "parse"]
