"""Too many bad records: the one sentence `prepack pack` and `prepack preflight` both fail with.

A bad record is input that could not become an example (malformed JSON, a missing
field, a conversation the format rejects). Examples dropped for their length or for
having no target tokens are not bad records: the input was fine, the max length was not.
"""

from __future__ import annotations

from collections.abc import Mapping

from prepack.packing.accounting import NOT_BAD_INPUT
from prepack.text.chat.base import CHAT_FORMAT_ERROR_ADVICE

# The default of --max-bad-fraction in `prepack pack` and `prepack preflight` alike: any bad
# record fails, so an estimate never stands on input the job would refuse.
DEFAULT_MAX_BAD_FRACTION = 0.0


def too_many_bad_records(bad_records: int, examples_read: int, reasons: Mapping[str, int], max_bad_fraction: float) -> str | None:
    """'N of M examples read are bad records (P%, more than --max-bad-fraction F): reason count, ...',
    or None when there is none or their fraction is within max_bad_fraction.

    reasons: reason -> count (examples_dropped); reasons that are not bad input are not listed.
    """
    fraction = bad_records / examples_read if examples_read else 0.0
    if not bad_records or fraction <= max_bad_fraction:
        return None
    bad = {k: v for k, v in reasons.items() if k not in NOT_BAD_INPUT and v}
    listed = ", ".join(f"{k} {v}" for k, v in sorted(bad.items(), key=lambda kv: (-kv[1], kv[0])))
    return (f"{bad_records} of {examples_read} examples read are bad records "
            f"({fraction:.2%}, more than --max-bad-fraction {max_bad_fraction:g}): {listed}{advice(bad)}")


def advice(reasons: Mapping[str, int]) -> str:
    """' (what to do)' for each reason that says more than its name (a dataset the chat format
    cannot lay out), '' for the others."""
    return "".join(f" ({CHAT_FORMAT_ERROR_ADVICE[k]})" for k in sorted(reasons) if reasons[k] and k in CHAT_FORMAT_ERROR_ADVICE)
