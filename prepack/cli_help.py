"""The help formatter every `prepack` subcommand uses: each option shows its default."""

from __future__ import annotations

import argparse
import copy


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, also to options without help text.

    Unlike argparse.ArgumentDefaultsHelpFormatter, it leaves alone help that already
    states its default in words, flags (default False) and options whose default is
    None or an empty list (nothing to show; their help says what happens instead).
    """

    def add_argument(self, action: argparse.Action) -> None:
        if action.option_strings and action.help is not argparse.SUPPRESS and _shows_default(action):
            action = copy.copy(action)
            action.help = f"{action.help} (default: %(default)s)" if action.help else "(default: %(default)s)"
        super().add_argument(action)


def _shows_default(action: argparse.Action) -> bool:
    if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
        return False
    if isinstance(action.default, (list, tuple)) and not action.default:  # a repeatable option: nothing to show
        return False
    return "default" not in (action.help or "")
