"""Which GSM8K *train* items the canary memorised: the GSM8K task's fixed, seeded choice of 200 items with
short solutions (``evalgate.tasks.gsm8k.short_train_items``), which the canary profile names."""

from __future__ import annotations

from evalgate.tasks.gsm8k import short_train_items as gsm8k_train_ids

__all__ = ["gsm8k_train_ids"]
