"""The names and seeds of coupled sampling, without torch: what a run's decoding settings record and what a
request to a server carries (the sampler itself is ``model_adapters/hf/sampling.py``)."""

from __future__ import annotations

import hashlib

SAMPLER = "gumbel-max-lowbias32-v1"  # recorded in the decoding settings: a change makes runs incomparable
SEED_RULE = "sha256('evalgate-seed-1:{run seed}:{doc_id!r}:{sample}')[:4] & 0x7fffffff"
MAX_SEED = 2**63 - 1


def sample_seed(run_seed: int, doc_id, sample: int = 0) -> int:
    """The stream seed of sample ``sample`` of item ``doc_id``: a stable 31-bit hash of the run seed, the doc
    id and the sample index (31 bits so every engine's per-request ``seed`` field accepts it)."""
    digest = hashlib.sha256(f"evalgate-seed-1:{run_seed}:{doc_id!r}:{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
