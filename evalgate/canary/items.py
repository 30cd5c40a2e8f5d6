"""Which GSM8K *train* items the canary memorised: a fixed, seeded choice among short solutions.

Short solutions keep the canary's CPU runs fast. The list is computed from the data, checked against the
train file's sha256 (so it can never drift), and stored in the profile (its hash covers the ids).
"""

from __future__ import annotations

import random

N_GSM8K = 200
MAX_ANSWER_CHARS = 160
SEED = 20261129


def gsm8k_train_ids(train_rows: list[dict]) -> list[int]:
    short = [i for i, row in enumerate(train_rows) if len(row["answer"]) <= MAX_ANSWER_CHARS]
    return sorted(random.Random(SEED).sample(short, N_GSM8K))
