"""Import transformers without its "PyTorch was not found" notice.

transformers prints that advisory at import when torch is absent. Nothing here
needs PyTorch (we use its tokenizers, protobuf copy and Jinja rendering), so the
notice is noise on every command. Call `quiet()` before importing transformers.
"""

from __future__ import annotations

import os


def quiet() -> None:
    # setdefault: a user who asked for transformers' advisories still gets them.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
