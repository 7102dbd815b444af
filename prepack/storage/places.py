"""The place a local path names, as the kernel resolves it: the one resolution of the project.

`resolved(path)` is where a writer that opens `path` writes: `~` expanded, the working folder
joined, every symlink followed, with `..` applied after the link before it (os.path.realpath).
os.path.abspath, which drops `s/..` without looking, names another place when `s` is a link:
with `s -> /elsewhere/x`, `s/..` is /elsewhere, not the working folder. `link_problem(path)` says
what on the way names no place at all (a dangling link, a link loop). The output rule
(output_rule.py) compares these places, and every writer writes at the string a command got from
output_rule.output_path; a writer given a path as typed resolves it here too (the same place).
No import of prepack.storage's package (it uses this module).
"""

from __future__ import annotations

import errno
import os

from prepack.storage.gcs import is_gcs


def resolved(path: str, cwd: str | None = None) -> str:
    """The place `path` names, as the kernel resolves it when a writer opens it: `~` expanded,
    joined with `cwd` (default: the working folder), then every symlink followed, with `..`
    applied after the link before it (os.path.realpath: with `s -> /elsewhere/x`, `s/..` is
    /elsewhere, not `.` as os.path.abspath would say); a trailing slash dropped. gs:// as it is.
    The one resolution of the project: the output rule compares these places, and every writer
    writes at the string a command got from `output_path` (resolving it again changes nothing)."""
    if is_gcs(path):
        return path
    local = os.path.expanduser(path)
    if not os.path.isabs(local):
        local = os.path.join(cwd if cwd is not None else os.getcwd(), local)
    return os.path.realpath(local)


def link_problem(path: str, cwd: str | None = None) -> str | None:
    """What breaks `path` on the way to its place, as the words after "FLAG PATH" (" is a dangling
    link ...", ": /a/s is a link loop ..."), or None. A dangling link would be followed to a place
    that does not exist (a writer would make the link's target, or fail), and a loop never ends:
    neither names a place an output could be checked at. gs:// has no links."""
    if is_gcs(path):
        return None
    local = os.path.expanduser(path)
    if not os.path.isabs(local):
        local = os.path.join(cwd if cwd is not None else os.getcwd(), local)
    parts = [p for p in local.split(os.sep) if p]
    done = os.sep  # the real folder reached so far
    todo = parts[::-1]  # the components still to walk, last first
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            done = os.path.dirname(done)
            continue
        here = os.path.join(done, name)
        if not os.path.islink(here):
            done = here
            continue
        try:
            os.stat(here)  # the whole chain of links from here: found, missing, or a loop
        except OSError as e:
            whole = not todo  # the path itself is the link (else a folder on its way)
            where = " is" if whole else f": {here} is"
            if e.errno == errno.ELOOP:
                return f"{where} a link loop (following it never ends); remove the link or give another path"
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return (f"{where} a dangling link (to {os.readlink(here)}, which does not exist); remove the link "
                        "or give another path")
            return None  # no access: the writer's own check says so
        target = os.readlink(here)
        if os.path.isabs(target):
            done = os.sep
        todo.extend(p for p in target.split(os.sep)[::-1] if p)
    return None
