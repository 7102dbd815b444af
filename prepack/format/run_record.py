"""OUTPUT/published.json: which manifests the output publishes (written last by each run's commit).

    {"run_id": "...",
     "lengths": {"64": {"manifest": "L64/manifest.json", "sha256": "<hex of that file's bytes>"}, ...},
     "tokens_manifest": "tokens/manifest.json" | null,
     "tokens_manifest_sha256": "<hex of tokens/manifest.json's bytes>" | null}

`run_id` is the run that wrote the record last. Its lengths are that run's and, when it ran
without --overwrite, the ones published before it (prepack/published.py). They are all
published when every file the record names has the sha256 it records. Read as a stranger's file: every field is checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from prepack.format import layout
from prepack.format.rowformat import MAX_MAX_LENGTH
from prepack.hostile_input import untrusted

class RunRecordError(ValueError):
    """published.json is not a valid run record; the message says which field."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class PublishedManifest:
    manifest: str  # relative to the output: L64/manifest.json
    sha256: str


@dataclasses.dataclass(frozen=True)
class RunRecord:
    run_id: str
    lengths: dict[int, PublishedManifest]
    tokens_manifest: str | None = None
    tokens_manifest_sha256: str | None = None

    @classmethod
    def of(cls, run_id: str, manifests: dict[int, bytes], tokens_manifest: bytes | None,
           kept: dict[int, PublishedManifest] | None = None) -> "RunRecord":
        """This run's manifests, beside `kept`: the lengths published before it that it keeps
        (prepack/published.py decides which)."""
        lengths = {**(kept or {}), **{L: PublishedManifest(length_manifest(L), sha256_hex(b)) for L, b in manifests.items()}}
        return cls(
            run_id=run_id,
            lengths=dict(sorted(lengths.items())),
            tokens_manifest=TOKENS_MANIFEST if tokens_manifest is not None else None,
            tokens_manifest_sha256=sha256_hex(tokens_manifest) if tokens_manifest is not None else None,
        )

    def to_json(self) -> str:
        d: dict[str, Any] = {
            "run_id": self.run_id,
            "lengths": {str(L): dataclasses.asdict(m) for L, m in sorted(self.lengths.items())},
            "tokens_manifest": self.tokens_manifest,
            "tokens_manifest_sha256": self.tokens_manifest_sha256,
        }
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = layout.RUN_RECORD_NAME) -> "RunRecord":
        """Checked field by field before any path in it is used (prepack.hostile_input.untrusted's rules):
        each manifest path must be exactly L<L>/manifest.json, each digest a sha256."""
        err = RunRecordError
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise err(f"{source}: not a valid run record (not JSON: {e}); {_REDO}") from None
        untrusted.mapping(d, source, "the record", err)
        run_id = untrusted.text(d.get("run_id"), source, "run_id", err)
        if not run_id:
            raise err(f"{source}: run_id is empty; {_REDO}")
        out = {}
        for key, entry in untrusted.mapping(d.get("lengths"), source, "lengths", err).items():
            if not re.fullmatch(r"[1-9][0-9]{0,9}", key):
                raise err(f"{source}: lengths key {key!r} is not a max length; {_REDO}")
            L = untrusted.count(int(key), source, f"lengths[{key}]", err, low=2, high=MAX_MAX_LENGTH)
            untrusted.mapping(entry, source, f"lengths[{key}]", err)
            expected = length_manifest(L)
            if entry.get("manifest") != expected:
                raise err(f"{source}: lengths[{key}].manifest {entry.get('manifest')!r:.80} is not {expected!r}; the run "
                          f"record was edited or is damaged: {_REDO}")
            out[L] = PublishedManifest(expected, untrusted.sha256_hex(entry.get("sha256"), source, f"lengths[{key}].sha256", err))
        if not out:
            raise err(f"{source}: lengths is empty; {_REDO}")
        tokens, tokens_sha = d.get("tokens_manifest"), d.get("tokens_manifest_sha256")
        if tokens is not None and tokens != TOKENS_MANIFEST:
            raise err(f"{source}: tokens_manifest {tokens!r:.80} is not {TOKENS_MANIFEST!r} or null; {_REDO}")
        if tokens_sha is not None:
            untrusted.sha256_hex(tokens_sha, source, "tokens_manifest_sha256", err)
        if (tokens is None) != (tokens_sha is None):
            raise err(f"{source}: tokens_manifest and tokens_manifest_sha256 must both be set or both null; {_REDO}")
        return cls(run_id, out, tokens, tokens_sha)


def length_manifest(max_length: int) -> str:
    """What the run record names as a length's manifest, relative to the output."""
    return f"L{max_length}/{layout.MANIFEST_NAME}"


TOKENS_MANIFEST = f"{layout.TOKENS_DIR}/{layout.MANIFEST_NAME}"
_REDO = "run `prepack pack --overwrite` again"
