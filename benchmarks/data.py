"""Where the benchmarks find the real SFT samples they measure on.

`$PREPACK_BENCH_DATA` (default `bench_data/` in the repository root, ignored by git) is a
folder holding samples of public datasets in their published JSONL shapes:
`alpaca.jsonl` (Stanford Alpaca), `oasst1.jsonl` and `oasst1_chat.jsonl` (OpenAssistant
OASST1: the message table, and prompt/response pairs), `opus_en_fr.jsonl` (OPUS-100 en-fr),
`dpo_zh_sharegpt.jsonl` (preference pairs: LLaMA-Factory's data/dpo_zh_demo.json, one record a
line, a ranking file `{conversations, chosen, rejected}`).
They are not shipped with the project; tests build their own fixtures instead.
"""

from __future__ import annotations

import os

DATA_DIR = os.environ.get("PREPACK_BENCH_DATA", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_data"))
