"""OUTPUT/published.json: which manifests one run published together (written last by the commit).

    {"run_id": "...",
     "lengths": {"64": {"manifest": "L64/manifest.json", "sha256": "<hex of that file's bytes>"}, ...},
     "tokens_manifest": "tokens/manifest.json" | null,
     "tokens_manifest_sha256": "<hex of tokens/manifest.json's bytes>" | null}

All lengths (and the tokenized set) of one run are published when every file the record
names has the sha256 it records. Read as a stranger's file: every field is checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from prepack import layout

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


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
    def of(cls, run_id: str, manifests: dict[int, bytes], tokens_manifest: bytes | None) -> "RunRecord":
        return cls(
            run_id=run_id,
            lengths={L: PublishedManifest(f"L{L}/{layout.MANIFEST_NAME}", sha256_hex(b)) for L, b in sorted(manifests.items())},
            tokens_manifest=f"{layout.TOKENS_DIR}/{layout.MANIFEST_NAME}" if tokens_manifest is not None else None,
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
        try:
            d = json.loads(text)
        except ValueError as e:
            raise RunRecordError(f"{source}: not JSON ({e})") from e
        if not isinstance(d, dict):
            raise RunRecordError(f"{source}: not a JSON object")
        run_id = d.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            raise RunRecordError(f"{source}: field run_id must be a non-empty string")
        lengths = d.get("lengths")
        if not isinstance(lengths, dict) or not lengths:
            raise RunRecordError(f"{source}: field lengths must be an object of max length -> manifest")
        out = {}
        for key, entry in lengths.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) > 0):
                raise RunRecordError(f"{source}: lengths key {key!r} is not a positive max length")
            L = int(key)
            if not isinstance(entry, dict) or entry.get("manifest") != f"L{L}/{layout.MANIFEST_NAME}":
                raise RunRecordError(f"{source}: lengths.{key}.manifest must be L{L}/{layout.MANIFEST_NAME}")
            if not isinstance(entry.get("sha256"), str) or not _HEX64.match(entry["sha256"]):
                raise RunRecordError(f"{source}: lengths.{key}.sha256 must be 64 hex digits")
            out[L] = PublishedManifest(entry["manifest"], entry["sha256"])
        tokens, tokens_sha = d.get("tokens_manifest"), d.get("tokens_manifest_sha256")
        if tokens is not None and tokens != f"{layout.TOKENS_DIR}/{layout.MANIFEST_NAME}":
            raise RunRecordError(f"{source}: field tokens_manifest must be {layout.TOKENS_DIR}/{layout.MANIFEST_NAME} or null")
        if (tokens is None) != (tokens_sha is None) or (tokens_sha is not None and not (
                isinstance(tokens_sha, str) and _HEX64.match(tokens_sha))):
            raise RunRecordError(f"{source}: field tokens_manifest_sha256 must be 64 hex digits when tokens_manifest is "
                                 "set, else null")
        return cls(run_id, out, tokens, tokens_sha)
