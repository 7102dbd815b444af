"""Whether a local path lies on a network file system (a gcsfuse mount), where each read waits on the network."""

from __future__ import annotations

import os


def _mount_points() -> list[tuple[str, str]]:
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            rows = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return []
    return [(point.replace("\\040", " "), fstype) for point, fstype in rows]


def is_network_mount(path: str) -> bool:
    """True if `path` lies on a FUSE (gcsfuse) or network file system, where each read waits on the network."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    for point, kind in _mount_points():
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, fstype = point, kind
    return fstype.startswith("fuse") or fstype in {"nfs", "nfs4", "cifs", "smb3"}
