"""k samples per item at temperature T with run seed S: what a run's sampling settings do to its profile
identity, its requests and the generations the tasks score (docs/scoring.md#k-samples).

Greedy (k = 1, T = 0) changes nothing: the profile's decoding settings, the requests and the records stay
exactly as they always were, so stored greedy baselines keep their profile ids. Any other setting adds k, T,
S and the sampler's name to the decoding settings, which are part of the profile id: runs with different
sampling settings are never compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from evalgate.errors import UserError
from evalgate.types import Generation, Request

MAX_SAMPLES = 1024
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class Sampling:
    """A run's sampling settings: ``samples`` per item (k), ``temperature`` (T), run ``seed`` (S)."""

    samples: int = 1
    temperature: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.samples == 1 and self.temperature == 0

    def check(self) -> "Sampling":
        """Itself, or UserError (one line) for settings that cannot be run."""
        if not isinstance(self.samples, int) or not 1 <= self.samples <= MAX_SAMPLES:
            raise UserError(f"--samples must be an integer from 1 to {MAX_SAMPLES}, got {self.samples!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise UserError(f"--temperature must be from 0 to {MAX_TEMPERATURE:g}, got {self.temperature!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"--seed must be a non-negative integer, got {self.seed!r}")
        if self.samples > 1 and self.temperature == 0:
            raise UserError(f"--samples {self.samples} at --temperature 0 repeats one greedy answer; "
                            "give --temperature > 0 (e.g. 0.8) or drop --samples")
        return self

    def decoding(self, greedy: dict) -> dict:
        """The decoding settings a profile records: the task's greedy ones unchanged, else k, T, S and the
        sampler (the seed rule and the sampler's name: a change to either makes samples differ)."""
        if self.greedy:
            return greedy
        from evalgate.model_adapters.sample_seeds import SAMPLER, SEED_RULE

        return {**greedy, "do_sample": True, "temperature": float(self.temperature), "n": self.samples,
                "seed": self.seed, "sampler": SAMPLER, "seed_rule": SEED_RULE}

    def expand(self, requests: list[Request]) -> list[Request]:
        """Greedy: the requests as they are. Sampled: k requests per item, sample j with its stream seed."""
        if self.greedy:
            return list(requests)
        from evalgate.model_adapters.sample_seeds import sample_seed

        return [replace(r, sample=j, temperature=float(self.temperature), seed=sample_seed(self.seed, r.doc_id, j))
                for r in requests for j in range(self.samples)]


class SampleGroups:
    """Collects sample generations until every sample of an item has arrived, then hands the item over.

    ``add(sample_requests, generations)`` takes them in any order and any grouping (a batch may split an
    item, a server answers out of order) and returns (item requests, per-item generations) for the items it
    completed: greedy, one Generation per item as always; sampled, the item's k Generations in sample order.
    """

    def __init__(self, sampling: Sampling, items: list[Request]):
        self.sampling = sampling
        self.items = {r.doc_id: r for r in items}
        self.pending: dict = {}

    def add(self, requests: list[Request], generations: list[Generation]) -> tuple[list[Request], list]:
        if self.sampling.greedy:
            return list(requests), list(generations)
        done_items, done_gens = [], []
        for request, gen in zip(requests, generations):
            got = self.pending.setdefault(request.doc_id, {})
            got[request.sample] = gen
            if len(got) == self.sampling.samples:
                done_items.append(self.items[request.doc_id])
                done_gens.append([got[j] for j in range(self.sampling.samples)])
                del self.pending[request.doc_id]
        return done_items, done_gens
