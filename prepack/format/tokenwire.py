"""Compact bytes for token ids and loss masks: the one encoding behind the job's token
shuffles (pipelines/wire/columns.py) and the tokenized set's records (prepack/format/tokenset.py).

Ids whose values all fit in 24 bits (any vocabulary up to 16.7M pieces, Gemma 3's 262k
included) take 3 bytes, a 0/1 mask takes bits; anything else is stored plain. The first
byte says which, so every buffer decodes on its own: 5 bytes per token become 3.125.
"""

from __future__ import annotations

import numpy as np

IDS = np.dtype("<i4")
MASK = np.dtype(np.uint8)

IDS_24 = b"\x03"
IDS_32 = b"\x04"
MASK_BITS = b"\x01"
MASK_BYTES = b"\x08"
MASK_COUNT_BYTES = 8  # after MASK_BITS: the number of mask values, little-endian


def ids_to_wire(ids: np.ndarray) -> bytes:
    ids = np.asarray(ids, dtype=IDS)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 24):
        return IDS_32 + ids.tobytes()
    return IDS_24 + ids.view(np.uint8).reshape(-1, 4)[:, :3].tobytes()


def ids_from_wire(data: bytes) -> np.ndarray:
    if data[:1] == IDS_32:
        return np.frombuffer(data, IDS, offset=1)
    packed = np.frombuffer(data, np.uint8, offset=1).reshape(-1, 3)
    out = np.zeros((len(packed), 4), np.uint8)
    out[:, :3] = packed
    return out.view(IDS).reshape(-1)


def ids_wire_size(tag: bytes, count: int) -> int:
    """Bytes of an ids buffer with this tag holding `count` ids."""
    return 1 + (3 if tag == IDS_24 else 4) * count


def mask_to_wire(mask: np.ndarray) -> bytes:
    mask = np.asarray(mask, dtype=MASK)
    if mask.size and int(mask.max()) > 1:
        return MASK_BYTES + mask.tobytes()
    return MASK_BITS + len(mask).to_bytes(MASK_COUNT_BYTES, "little") + np.packbits(mask).tobytes()


def mask_from_wire(data: bytes) -> np.ndarray:
    if data[:1] == MASK_BYTES:
        return np.frombuffer(data, MASK, offset=1)
    count = int.from_bytes(data[1 : 1 + MASK_COUNT_BYTES], "little")
    return np.unpackbits(np.frombuffer(data, np.uint8, offset=1 + MASK_COUNT_BYTES), count=count)


def mask_wire_size(tag: bytes, count: int) -> int:
    """Bytes of a mask buffer with this tag holding `count` values."""
    return 1 + MASK_COUNT_BYTES + (count + 7) // 8 if tag == MASK_BITS else 1 + count
