"""The command-line conventions every `prepack` subcommand shares: its parser (CommandParser: one
line for a bad argument, a suggestion for a misspelt option, no abbreviations), its help formatter
(each option shows its default) and its exit codes.

Exit codes, the same for every command (README, "Exit codes"):
  0  done;
  1  the command started and failed: a job that failed, a check that found a fault (verify, parity),
     a corrupt row met while reading;
  2  refused before any work, in one line: a bad option or value, an input that cannot be used,
     an output that exists without --overwrite, a missing extra.
(`prepack train` adds 3: a non-finite loss under --nan-policy stop; 130 is an interrupt.)
"""

from __future__ import annotations

import argparse
import copy
import difflib
from collections.abc import Iterable

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2


def closest_option(name: str, known: Iterable[str]) -> str | None:
    """The option `name` most likely misspells (or abbreviates), or None when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def long_options(parser: argparse.ArgumentParser) -> list[str]:
    """Every --option the parser defines."""
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--")]


def unknown_option_line(name: str, known: Iterable[str], prog: str) -> str:
    """The one line for an option the command does not define: the option meant, or where to look."""
    close = closest_option(name, known)
    return f"unknown option {name}; " + (f"did you mean {close}?" if close else f"see {prog} --help")


class CommandParser(argparse.ArgumentParser):
    """Every subcommand's parser. A bad argument is one line and exit status 2, as every refusal;
    an option the command does not define (a typo, or an abbreviation: abbreviations are refused,
    so `--row` never silently means `--rows`) names the option meant. Options default to showing
    their defaults in --help (DefaultsHelpFormatter)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_REFUSED, f"{self.prog}: error: {self.refusal(message)}\n")

    def refusal(self, message: str) -> str:
        """argparse's `message` as the command's one line."""
        prefix = "unrecognized arguments: "
        flags = [a for a in message[len(prefix):].split() if a.startswith("-")] if message.startswith(prefix) else []
        if flags:
            return unknown_option_line(flags[0].split("=", 1)[0], long_options(self), self.prog)
        return f"{message} (see {self.prog} --help)"


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
