"""How many examples the property tests of hostile inputs draw (tests/test_hostile_*.py).

The fast tier draws a few hundred per test; the slow tier's deep runs draw DEEP_EXAMPLES. Every
run draws the same examples (conftest.py's derandomized profile), so a deep run's worth is the
breadth of one fixed sample: 2,000 drawn inputs per test cover the strategies' branches (the
manifest fields, the JSON shapes, the line kinds) many times over, at a fifth of the 10,000 the
suite used to draw, whose minutes kept CI near its limit. To search further, set
PREPACK_DEEP_FUZZ_EXAMPLES (e.g. 50000) and pass `--hypothesis-profile explore` for fresh draws.
"""

from __future__ import annotations

import os

DEEP_EXAMPLES = int(os.environ.get("PREPACK_DEEP_FUZZ_EXAMPLES", "2000"))
