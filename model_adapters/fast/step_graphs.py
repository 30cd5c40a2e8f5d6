"""Whole decoding steps of a DeepSeek-V4 model over a ``SlotCache`` as CUDA graphs, one per batch bucket.

An eager step launches thousands of kernels from Python for every layer, and the GPU waits on the host
between them: at 12 full-width layers the step takes about as long at batch 1 as at batch 256. Here a step
of ``b`` rows runs as the graph of its bucket (the smallest power of two >= b, at most the cache's slots):
its tokens and slot indices are copied into the bucket's buffers, the rows beyond ``b`` point at the cache's
spare slot (``SlotCache(spare=1)``, never admitted, so nothing live is written), and one replay runs every
layer. A bucket's first step runs eagerly (Triton compiles its kernels), its second captures the graph.

The Triton MoE path's host sync (how many rows its fast path left: rows whose activations span more than it
holds, rare) is deferred (``moe.defer_finish``): the graph adds the counts of every layer up, and the step
reads that one number after the replay. When it is not 0 the step runs again without the graph from the same
inputs, every layer finishing its rows on the per-block path; a step run twice leaves the state it leaves
once (``SlotCache.forward``), so the result is the eager step's. A graphed step computes the same bits as an
eager step of the bucket's size; with PyTorch's numerics a matrix product of fewer rows may round otherwise.
"""

from __future__ import annotations

import warnings

import torch

from evalgate.kernels.triton import dispatch, moe
from evalgate.model_adapters.fast.attention_slots import SlotCache

ENABLED = True  # a switch for comparisons (benchmarks/dsv4_flash_fullwidth.py runs both)


def bucket_of(rows: int, slots: int) -> int:
    """The smallest power of two holding ``rows``, at most ``slots``."""
    size = 1
    while size < rows:
        size *= 2
    return min(size, slots)


def why_not(cache: SlotCache) -> str | None:
    """Why steps over ``cache`` cannot be graphed whole; None if they can."""
    device = cache.positions.device
    if device.type != "cuda":
        return "not on a GPU"
    from evalgate.model_adapters.canonical.invariant import numerics

    if numerics(cache.model) != "native":  # its correctly rounded functions decide some elements on the host
        return "canonical numerics synchronise with the host"
    if cache.positions.numel() <= cache.slots:
        return "the cache has no spare slot for padding rows"
    if len({p.device for p in cache.model.parameters()}) > 1:
        return "the model spans several devices"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    fn = ALL_EXPERTS_FUNCTIONS.get(getattr(cache.model.config, "_experts_implementation", None))
    recipe = getattr(fn, "recipe", None)
    if recipe is None:
        return "the experts do not run an emulated kernel's Triton path"
    if not dispatch.use_triton(torch.empty(0, device=device), recipe):
        return f"recipe {recipe} does not run on Triton here"
    return moe.capturable(recipe)


class _Bucket:
    """One bucket's buffers and graph. ``graph=False`` runs the same sync-free body eagerly every step."""

    def __init__(self, cache: SlotCache, size: int, graph: bool, pool):
        device = cache.positions.device
        self.cache, self.size, self.pool = cache, size, pool
        self.spare = cache.slots  # the first spare slot
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.rows = torch.full((size,), self.spare, dtype=torch.long, device=device)
        self.graph, self.capture, self.calls = None, graph, 0
        self.logits = self.slow = None

    def _body(self):
        with moe.defer_finish() as layers:
            logits = self.cache.forward(self.tokens, self.rows)
            return logits, layers.slow_rows(self.rows.device)

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits, self.slow = self._body()
        except Exception as exc:  # noqa: BLE001  (something in the step syncs: this bucket stays eager)
            warnings.warn(f"decoding steps of {self.size} rows run without a CUDA graph: {exc}", stacklevel=3)
            self.capture = False
            return
        self.graph = graph

    def run(self, tokens: torch.Tensor, rows: list[int], stats: dict) -> torch.Tensor:
        b = len(rows)
        self.tokens[:b].copy_(tokens)
        self.rows.copy_(torch.tensor(rows + [self.spare] * (self.size - b)))
        if self.capture and self.graph is None and self.calls:
            self._capture()
            stats["captures"] += self.graph is not None
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            logits, slow = self.logits, self.slow
            stats["replays"] += 1
        else:
            logits, slow = self._body()
            stats["eager"] += 1
        if int(slow):  # rows the fast path left: the whole step again, finishing them (the same state after)
            logits = self.cache.forward(self.tokens, self.rows)
            stats["reruns"] += 1
        return logits[:b].clone()


class StepGraphs:
    """``step(tokens, rows)``: ``SlotCache.decode_step`` through a graph of the whole step per batch bucket
    where ``why_not`` allows (else eagerly, as ``decode_step``). ``graphs=False``: the graphed path's body
    without capturing (what a CPU runs in tests)."""

    def __init__(self, cache: SlotCache, graphs: bool | None = None):
        self.cache = cache
        self.reason = why_not(cache) if ENABLED else "disabled"
        if graphs and self.reason is not None:
            raise ValueError(f"decoding steps cannot be graphed: {self.reason}")
        self.graphs = self.reason is None if graphs is None else graphs
        self.bucketed = self.graphs or (graphs is False and cache.positions.numel() > cache.slots)
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.buckets: dict[int, _Bucket] = {}
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "reruns": 0}

    def logits(self, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The step's logits [b, V] for slots ``rows`` fed ``tokens`` [b], leaving their positions as they are."""
        if not self.bucketed:
            return self.cache.forward(tokens, torch.tensor(rows, device=self.cache.positions.device))
        size = bucket_of(len(rows), self.cache.slots)
        if size not in self.buckets:
            self.buckets[size] = _Bucket(self.cache, size, self.graphs, self.pool)
        return self.buckets[size].run(tokens, rows, self.stats)

    def step(self, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """One token for each slot of ``rows``: the logits [b, V] of the next token (``decode_step``)."""
        self.cache.check(rows)
        logits = self.logits(tokens, rows)
        self.cache.advance(torch.tensor(rows, device=self.cache.positions.device), rows)
        return logits
