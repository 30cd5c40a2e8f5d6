"""Batched decoding with left padding and per-sequence stop strings: greedy, or keyed (coupled) sampling.

A small loop of our own instead of ``model.generate``: every row gets explicit position ids from its own
attention mask (so left padding never shifts positions), each row stops on its own stop strings or EOS,
and the loop ends when all rows are done. Only the last position's logits are computed, and the next
token is their argmax (the lowest index among equal maxima). A row given a ``SampleKey`` samples instead:
argmax(logits / T + Gumbel noise keyed by its stream seed and position), ``evalgate.model_adapters.hf.sampling``;
its tokens depend on its prompt, seed and temperature alone, like a greedy row's on its prompt.

With canonical numerics (``invariant.install``, what ``hf.load_model`` does by default) what a row produces
is a function of its prompt alone: not of its batch neighbours, the padding, the thread count or the CPU's
instruction set (``tests/test_invariance.py``). With PyTorch's own numerics it can differ in the last bits,
and a near-tie can flip.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from evalgate.model_adapters.hf.sampling import SampleKey, next_tokens
from evalgate.model_adapters.stops import cut_at_stop


@dataclass
class RawGeneration:
    token_ids: list[int]  # generated tokens, up to and including the one that completed a stop / EOS
    text: str  # decoded, cut before the first stop string
    finish_reason: str  # "stop" | "length"
    stop_hit: str | None
    n_prompt_tokens: int
    latency_s: float | None = None  # from the start of its prefill to its last token


def greedy_generate(model, tokenizer, prompts: list[str], stops: list[tuple[str, ...]], max_new_tokens: list[int],
                    device: str = "cpu") -> list[RawGeneration]:
    """Every row greedy (argmax)."""
    return decode(model, tokenizer, prompts, stops, max_new_tokens, device)


@torch.inference_mode()
def decode(model, tokenizer, prompts: list[str], stops: list[tuple[str, ...]], max_new_tokens: list[int],
           device: str = "cpu", keys: list[SampleKey | None] | None = None) -> list[RawGeneration]:
    """One generation per prompt; row i samples with ``keys[i]``, or is greedy when that is None (or no keys).
    All rows start together; a row that finishes leaves the batch (``decode_stream``)."""
    out: list[RawGeneration | None] = [None] * len(prompts)
    for finished in decode_stream(model, tokenizer, prompts, stops, max_new_tokens, device, keys):
        for i, g in finished:
            out[i] = g
    return out


REFILL_FRACTION = 4  # continuous batching: new prompts are admitted once a quarter of the slots is free
# Finished rows leave the batch (a copy of the whole KV cache) once more than 1/16 of it is finished, or
# before new prompts join: until then they decode a pad token, which costs less than a copy per finish.
COMPACT_FRACTION = 16


@dataclass
class DecodeStats:
    """Where one decoding loop's time went (``decode_stream(stats=...)``; benchmarks/bench_generate.py
    --stream). CPU seconds of the loop's own thread; a step with fewer than ``FEW_ROWS`` rows still to
    decode costs nearly a full step's fixed part for a few tokens (the tail of a worker's longest rows)."""

    prefill_calls: int = 0
    prefill_tokens: int = 0  # pads included: what the calls computed
    prompt_tokens: int = 0  # the prompts' own tokens (over prefill_tokens where a prefix cache served them)
    prefill_cpu_s: float = 0.0
    steps: int = 0
    row_steps: int = 0  # rows decoded, summed over the steps (finished rows not yet dropped included)
    steps_with_few_rows: int = 0
    decode_cpu_s: float = 0.0


FEW_ROWS = 8


@dataclass
class _Row:
    index: int  # the prompt's index in the call
    generated: list[int]
    t0: float  # when its prefill started
    text: str = ""
    reason: str = "length"
    hit: str | None = None
    done: bool = False


@torch.inference_mode()
def decode_stream(model, tokenizer, prompts: list[str], stops: list[tuple[str, ...]], max_new_tokens: list[int],
                  device: str = "cpu", keys: list[SampleKey | None] | None = None, batch_size: int | None = None,
                  refill: int | None = None, workers: int = 1, stats: list | None = None,
                  expected_tokens: list[int | None] | None = None):
    """``decode`` as a stream with continuous batching: yields lists of (prompt index, RawGeneration) as rows
    finish. At most ``batch_size`` rows (default: all) decode together; a finished row leaves the batch
    (its rows of the KV cache, mask and positions are dropped, and padding no live row needs is cut), and
    once ``refill`` slots (default: a quarter of the batch) are free the next prompts, most work first, are
    prefilled in groups of like length and joined to the batch, left-padded to the cache's length.
    ``workers`` > 1 forks that many processes (one thread each) that take prompts from the same queue
    (``_parallel``). ``stats``: a list that gets each decoding loop's ``DecodeStats`` when it ends.
    ``expected_tokens``: how long each answer is expected to be (e.g. the stored baseline's; None for a prompt
    without one; none at all, or only None: the queue as without them), which orders the queue by expected cost and lets each worker take only its share of it
    (``_SharedQueue``); a schedule, never an output.

    With canonical numerics a row's tokens are a function of its prompt alone, so none of this changes what
    a row produces (``tests/test_invariance.py``). With PyTorch's own numerics, and for caches this does not
    know how to splice, the batches are static: the next one starts when every row of the last one is done,
    and finished rows keep decoding a pad token, as they always did (and there is one worker)."""
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    n = len(enc)
    if n == 0:
        return
    if max(max_new_tokens) <= 0:  # nothing to generate (a row with 0 still got one token beside others)
        yield [(i, RawGeneration([], "", "length", None, len(enc[i]))) for i in range(n)]
        return
    dynamic = _dynamic(model, enc, max_new_tokens)
    # the most work first, so the tail is made of short rows: without expected lengths, prompt plus token
    # limit (an upper bound on a row's cost; e.g. HumanEval, 320 tokens, before GSM8K)
    if expected_tokens is None or all(x is None for x in expected_tokens):
        costs = None
        order = sorted(range(n), key=lambda i: -(len(enc[i]) + max_new_tokens[i])) if dynamic else list(range(n))
    else:
        costs = Costs.of(enc, max_new_tokens, expected_tokens)
        order = sorted(range(n), key=lambda i: -costs.whole[i]) if dynamic else list(range(n))
    args = (model, tokenizer, enc, stops, max_new_tokens, device, keys, batch_size, refill, dynamic)
    if dynamic and workers > 1 and n > 1 and hasattr(os, "fork"):
        yield from _parallel(args, order, workers, stats, costs)
    else:
        yield from (_decode_slots if _slot_decoding(model, device) else _decode_queue)(*args, _LocalQueue(order), stats)


@torch.inference_mode()
def _decode_queue(model, tokenizer, enc, stops, max_new_tokens, device, keys, batch_size, refill, dynamic, queue,
                  stats: list | None = None):
    n = len(enc)
    spent = DecodeStats()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_ids = set(_eos_ids(model, tokenizer))
    batch_size = max(1, batch_size or n)
    refill = max(1, refill or batch_size // REFILL_FRACTION)
    state = None  # (past, mask [b, T], last positions [b, 1], last tokens [b, 1]) of the rows in ``live``
    # static batches of PyTorch's numerics are prefilled a few rows per call; canonical ones as they always were
    prefill = _prefill if dynamic or _canonical(model) else _prefill_in_parts
    live: list[_Row] = []
    while True:
        alive = sum(not r.done for r in live)
        free = batch_size - alive
        if not alive or (dynamic and free >= refill):
            take = queue.take(free, [(r.index, len(r.generated)) for r in live if not r.done])
        else:
            take = []
        if take and alive < len(live):  # rows that finished since the last compaction leave first
            live, state = _without_finished(live, state)
        if take:
            groups = _like_lengths(take, enc) if dynamic else [take]
            parts = []
            for group in groups:
                rows = [_Row(i, [], time.perf_counter()) for i in group]
                t0 = time.thread_time()
                # a prompt taken more than once (an item's samples) is prefilled once and its row repeated
                unique, of = _distinct(group, enc) if dynamic and PREFIX_CACHE else (group, None)
                logits, new_state = prefill(model, [enc[i] for i in unique], pad_id, device)
                if of is not None:
                    logits, new_state = logits[of], _select(new_state, of)
                state = new_state if not live else _join(state, new_state)
                spent.prefill_cpu_s += time.thread_time() - t0
                spent.prefill_calls += 1
                spent.prefill_tokens += len(unique) * max(len(enc[i]) for i in group)
                spent.prompt_tokens += sum(len(enc[i]) for i in group)
                live.extend(rows)
                parts.append(logits)
            stepped = live[len(live) - len(take):]
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        elif live:
            t0 = time.thread_time()
            past, mask, last_pos, last_tok = state
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=mask.device)], -1)
            positions = last_pos + 1
            out = model(input_ids=last_tok, attention_mask=mask, position_ids=positions, past_key_values=past,
                        use_cache=True, logits_to_keep=1)
            state = (out.past_key_values, mask, positions, last_tok)
            logits = out.logits[:, -1, :].float()
            stepped = live
            spent.decode_cpu_s += time.thread_time() - t0
            if queue.balances:
                queue.publish([(r.index, len(r.generated)) for r in live if not r.done])
            spent.steps += 1
            spent.row_steps += len(live)
            spent.steps_with_few_rows += sum(not r.done for r in live) < FEW_ROWS
        else:
            if stats is not None:
                stats.append(spent)
            return
        tokens = _choose(logits, stepped, keys)
        finished = []
        for r, tok in zip(stepped, tokens):
            if r.done:
                continue
            _advance(r, tok, tokenizer, eos_ids, stops[r.index], max_new_tokens[r.index])
            if r.done:
                finished.append((r.index, RawGeneration(r.generated, r.text, r.reason, r.hit, len(enc[r.index]),
                                                        time.perf_counter() - r.t0)))
        feed = [pad_id if r.done else r.generated[-1] for r in live]
        past, mask, last_pos, _ = state
        state = (past, mask, last_pos, torch.tensor(feed, dtype=torch.long, device=mask.device).unsqueeze(-1))
        done = sum(r.done for r in live)
        if done == len(live):
            live, state = [], None
        elif dynamic and done > len(live) // COMPACT_FRACTION:
            live, state = _without_finished(live, state)
        if finished:
            yield finished


def _slot_decoding(model, device) -> bool:
    """Whether a batch decodes from per-row slots (``attention_slots.SlotCache``): a DeepSeek-V4 model that
    keeps PyTorch's numerics, on a GPU; or one with canonical numerics and compressed attention, anywhere.
    There rows join and leave, and a row's compressor windows follow its own positions, not a padded
    batch's (with canonical numerics a left-padded sliding-window batch stays as it is: its rows are
    already their own)."""
    from evalgate.model_adapters.canonical.invariant_compressed import compressed_attention

    if _canonical(model):
        return compressed_attention(model)
    return str(device).startswith("cuda") and getattr(model.config, "model_type", None) == "deepseek_v4"


@torch.inference_mode()
def _decode_slots(model, tokenizer, enc, stops, max_new_tokens, device, keys, batch_size, refill, dynamic, queue,
                  stats: list | None = None):
    """``_decode_queue`` over a ``SlotCache`` of ``batch_size`` slots: the prompts a take admits are prefilled
    in their free slots (``PromptCache``: the shared prefix copied, then their own tokens together; with
    both switches off, each alone by the model's forward and moved in), every step decodes one token for each
    slot in use, a finished row's slot takes the next prompt once ``refill`` slots are free. On one GPU a step runs as a CUDA graph of the whole step
    for its batch bucket (``step_graphs.StepGraphs``)."""
    from evalgate.model_adapters.fast.attention_slots import SlotCache
    from evalgate.model_adapters.fast.step_graphs import StepGraphs

    n = len(enc)
    spent = DecodeStats()
    eos_ids = set(_eos_ids(model, tokenizer))
    batch_size = max(1, min(batch_size or n, n))
    refill = max(1, refill or batch_size // REFILL_FRACTION)
    in_slots = PREFIX_CACHE or BATCHED_PREFILL
    stores = 1 + PROMPT_STORES if in_slots and PREFIX_CACHE else 0
    cache = SlotCache(model, batch_size, max(len(e) + m for e, m in zip(enc, max_new_tokens)) + 1, spare=1 + stores)
    prompts = PromptCache(cache, enc, range(batch_size + 1, batch_size + 1 + stores)) if in_slots else None
    steps = StepGraphs(cache)
    free = list(range(batch_size - 1, -1, -1))  # popped from the end: slot 0 first
    live: dict[int, _Row] = {}  # slot -> row
    fed = torch.zeros(batch_size, dtype=torch.long, device=cache.positions.device)
    while True:
        finished = []
        if free and (not live or len(free) >= refill) and prompts is not None:
            take = queue.take(len(free), [(r.index, len(r.generated)) for r in live.values()])
            if take:
                slots = [free.pop() for _ in take]
                t0 = time.thread_time()
                calls, computed = cache.prefill_calls, cache.prefill_tokens
                logits = prompts.admit(slots, take)
                spent.prefill_cpu_s += time.thread_time() - t0
                spent.prefill_calls += cache.prefill_calls - calls
                spent.prefill_tokens += cache.prefill_tokens - computed
                spent.prompt_tokens += sum(len(enc[i]) for i in take)
                for slot, i in zip(slots, take):
                    live[slot] = _Row(i, [], time.perf_counter())
                finished += _take_tokens(logits.float(), slots, live, fed, free, tokenizer, eos_ids, stops,
                                         max_new_tokens, keys, enc)
        elif free and (not live or len(free) >= refill):
            for i in queue.take(len(free), [(r.index, len(r.generated)) for r in live.values()]):
                slot, row = free.pop(), _Row(i, [], time.perf_counter())
                t0 = time.thread_time()
                out = model(input_ids=torch.tensor([enc[i]], device=device), use_cache=True, logits_to_keep=1)
                cache.admit(slot, out.past_key_values, len(enc[i]))
                spent.prefill_cpu_s += time.thread_time() - t0
                spent.prefill_calls += 1
                spent.prefill_tokens += len(enc[i])
                spent.prompt_tokens += len(enc[i])
                live[slot] = row
                finished += _take_tokens(out.logits[:, -1].float(), [slot], live, fed, free, tokenizer, eos_ids,
                                         stops, max_new_tokens, keys, enc)
        if live:
            slots = sorted(live)
            t0 = time.thread_time()
            logits = steps.step(fed[slots], slots).float()
            spent.decode_cpu_s += time.thread_time() - t0
            spent.steps += 1
            spent.row_steps += len(slots)
            spent.steps_with_few_rows += len(slots) < FEW_ROWS
            finished += _take_tokens(logits, slots, live, fed, free, tokenizer, eos_ids, stops, max_new_tokens, keys,
                                     enc)
            if queue.balances:
                queue.publish([(r.index, len(r.generated)) for r in live.values()])
        if finished:
            yield finished
        if not live and queue.exhausted():
            if stats is not None:
                stats.append(spent)
            return


# Prefill in the slots (``SlotCache.prefill``; switches for comparisons, benchmarks/dsv4_flash_fullwidth.py):
# the prompts' shared prefix (every 8-shot GSM8K prompt starts with the same exemplars) and a prompt whose
# samples are queued again computed once, from a spare slot; each take's prompts prefilled together
PREFIX_CACHE = True
BATCHED_PREFILL = True
PROMPT_STORES = 4  # spare slots keeping a whole prompt while more of its samples are queued


def shared_prefix(enc: list[list[int]]) -> int:
    """How many leading tokens every prompt shares, short of the shortest prompt's last (which gives its
    logits); 0 for a single prompt."""
    if len(enc) < 2:
        return 0
    first, n = enc[0], min(map(len, enc)) - 1
    for e in enc[1:]:
        k = 0
        while k < n and e[k] == first[k]:
            k += 1
        n = k
    return max(0, n)


class PromptCache:
    """Prompts into ``SlotCache`` slots (``admit``): the prefix all of ``enc`` share is computed once into the
    first of ``stores`` (spare slots) and copied into each slot, which is then fed the prompt's own tokens;
    a prompt with more of its samples still to come is kept whole in another store (with its logits) and
    copied, not computed again. With canonical numerics a slot so filled holds, bit for bit, what a prefill
    of the whole prompt alone gives (``tests/test_prefix_cache.py``)."""

    def __init__(self, cache, enc: list[list[int]], stores):
        self.cache, self.enc = cache, enc
        stores = list(stores)
        self.prefix = shared_prefix(enc) if PREFIX_CACHE and stores else 0
        self.prefix_slot = stores[0] if stores else None
        self.free_stores = stores[1:]
        self.kept: dict[tuple, tuple[int, torch.Tensor]] = {}  # prompt -> (store slot, its last logits)
        self.to_come: dict[tuple, int] = {}
        for e in enc:
            self.to_come[tuple(e)] = self.to_come.get(tuple(e), 0) + 1
        self.prefilled = False

    def admit(self, slots: list[int], take: list[int]) -> torch.Tensor:
        """Prompts ``take`` (indices into ``enc``) into ``slots``: the logits [len(take), V] after each."""
        cache, logits = self.cache, [None] * len(take)
        if self.prefix and not self.prefilled:
            cache.start(self.prefix_slot)
            cache.prefill([self.prefix_slot], [self.enc[take[0]][:self.prefix]])
            self.prefilled = True
        first: dict[tuple, int] = {}  # a prompt computed in this take -> its position in it
        compute, copies = [], []
        for j, (slot, i) in enumerate(zip(slots, take)):
            key = tuple(self.enc[i])
            self.to_come[key] -= 1
            if key in self.kept:
                store, logits[j] = self.kept[key]
                cache.copy(store, slot)
            elif key in first:
                copies.append((j, first[key]))
            else:
                first[key] = j
                if self.prefix:
                    cache.copy(self.prefix_slot, slot)
                else:
                    cache.start(slot)
                compute.append(j)
        if compute:
            tails = [self.enc[take[j]][self.prefix:] for j in compute]
            if BATCHED_PREFILL:
                out = cache.prefill([slots[j] for j in compute], tails)
            else:
                out = torch.cat([cache.prefill([slots[j]], [t]) for j, t in zip(compute, tails)])
            for j, row in zip(compute, out):
                logits[j] = row
        for j, src in copies:
            cache.copy(slots[src], slots[j])
            logits[j] = logits[src]
        for j in compute:  # kept while more of its samples are to come and a store is free
            key = tuple(self.enc[take[j]])
            if self.to_come[key] > 0 and self.free_stores:
                store = self.free_stores.pop()
                cache.copy(slots[j], store)
                self.kept[key] = (store, logits[j])
        for key in [k for k in self.kept if self.to_come[k] == 0]:
            self.free_stores.append(self.kept.pop(key)[0])
        return torch.stack(logits)


def _take_tokens(logits, slots: list[int], live: dict, fed, free: list[int], tokenizer, eos_ids, stops,
                 max_new_tokens, keys, enc) -> list:
    """Each slot's row takes its next token (``_choose``); the token is what the slot is fed next. A row that
    finishes leaves its slot free. Returns the finished (prompt index, RawGeneration)."""
    rows = [live[s] for s in slots]
    chosen = _choose(logits, rows, keys)
    fed[torch.tensor(slots, device=fed.device)] = torch.tensor(chosen, device=fed.device)
    finished = []
    for slot, r, tok in zip(slots, rows, chosen):
        _advance(r, tok, tokenizer, eos_ids, stops[r.index], max_new_tokens[r.index])
        if r.done:
            finished.append((r.index, RawGeneration(r.generated, r.text, r.reason, r.hit, len(enc[r.index]),
                                                    time.perf_counter() - r.t0)))
            del live[slot]
            free.append(slot)
    return finished


def _without_finished(live: list[_Row], state):
    """The rows still decoding and their state (``_select``); (``[]``, None) when none is."""
    keep = [j for j, r in enumerate(live) if not r.done]
    return [live[j] for j in keep], (_select(state, keep) if keep else None)


# Expected costs, in decoded rows (one row of one decoding step). Measured on the canary (2-core EPYC, batch
# 128): a step costs ~52 ms + ~1.3 ms per row; a prefilled prompt token ~0.7 ms.
STEP_ROWS = 50.0  # a step's fixed part: a row's last steps cost that much each, whatever else decodes beside it
PREFILL_TOKEN_ROWS = 0.55  # a prompt token, prefilled


@dataclass
class Costs:
    """What each prompt is expected to cost a decoding worker (``_SharedQueue``)."""

    tokens: list[int]  # the answer's expected length: the given one, capped by the token limit; else the limit
    whole: list[float]  # each prompt's whole cost alone: its prefill plus its tokens

    @classmethod
    def of(cls, enc, max_new_tokens, expected_tokens) -> "Costs":
        tokens = [m if x is None else max(1, min(int(x), m)) for m, x in zip(max_new_tokens, expected_tokens)]
        return cls(tokens, [PREFILL_TOKEN_ROWS * len(e) + t for e, t in zip(enc, tokens)])

    def load(self, rest: list[float], prefill: float = 0.0) -> float:
        """What a worker has left: its rows' remaining tokens, the steps its longest row still needs (a step's
        fixed part, paid whatever else decodes beside it) and prompts not yet prefilled."""
        return sum(rest) + STEP_ROWS * max(rest, default=0.0) + prefill

    def rest(self, live) -> list[float]:
        """Tokens still expected of each live row, (prompt index, tokens generated); at least one."""
        return [max(self.tokens[i] - n, 1.0) for i, n in live]


class _LocalQueue:
    """Prompt indices in the order they are admitted."""

    balances = False  # whether ``publish`` is wanted after each step

    def __init__(self, order: list[int]):
        self.order, self.next = order, 0

    def take(self, k: int, live=()) -> list[int]:
        """Up to ``k`` prompts. ``live``: the taker's rows still decoding, (prompt index, tokens generated)."""
        out = self.order[self.next:self.next + k]
        self.next += len(out)
        return out

    def publish(self, live) -> None:
        """The taker's rows still decoding, after a step (what a shared queue balances on)."""

    def exhausted(self) -> bool:
        """Whether every prompt has been taken."""
        return self.next >= len(self.order)


class _SharedQueue(_LocalQueue):
    """The same order shared by forked workers: a counter in shared memory says how far it has been taken.

    Without costs, near the end of the queue a worker takes only a fair share of what is left, so that the last
    prompts spread over the workers instead of leaving one decoding a full batch alone. With ``Costs`` every
    worker publishes what it has left after each step, and takes the next prompts only while that is below
    an even split of all that is left (the workers' and the queue's): the worker that took the costliest
    prompts, whose longest answer sets its finish, takes fewer of the rest and the workers end together."""

    def __init__(self, order: list[int], ctx, workers: int, costs: Costs | None = None):
        super().__init__(order)
        self.counter = ctx.Value("q", 0)
        self.workers = workers
        self.costs = costs
        # each worker's load, written by that worker alone (a lone aligned double: no lock), read by the others
        self.loads = ctx.Array("d", workers, lock=False)
        self.worker = 0  # which worker this process is (``of_worker``)
        self.queued = [0.0] * (len(order) + 1)  # the cost of order[j:]
        if costs is not None:
            for j in range(len(order) - 1, -1, -1):
                self.queued[j] = self.queued[j + 1] + costs.whole[order[j]]

    @property
    def balances(self) -> bool:
        return self.costs is not None

    def of_worker(self, worker: int) -> "_SharedQueue":
        """This queue as worker ``worker`` uses it: called just before that worker is forked, which keeps its
        own copy of this object (the counter and the loads stay shared)."""
        self.worker = worker
        return self

    def publish(self, live) -> None:
        self.loads[self.worker] = self.costs.load(self.costs.rest(live))

    def exhausted(self) -> bool:
        return self.counter.value >= len(self.order)

    def take(self, k: int, live=()) -> list[int]:
        with self.counter.get_lock():
            start = self.counter.value
            if self.costs is None:
                left = len(self.order) - start
                if left < k * self.workers:
                    k = min(k, -(-left // self.workers))
                end = min(len(self.order), start + k)
            else:
                end = self._share(start, k, live)
            self.counter.value = end
        return self.order[start:end]

    def _share(self, start: int, k: int, live) -> int:
        """Where this worker's take ends: prompts while its load is below an even split of everything left
        (an idle worker takes at least one)."""
        costs, rest = self.costs, self.costs.rest(live)
        self.loads[self.worker] = mine = costs.load(rest)
        share = (self.queued[start] + sum(self.loads)) / self.workers
        end, prefill = start, 0.0
        while end < len(self.order) and end - start < k and (mine < share or (not live and end == start)):
            i = self.order[end]
            rest.append(float(costs.tokens[i]))
            prefill += costs.whole[i] - costs.tokens[i]
            mine = costs.load(rest, prefill)
            end += 1
        self.loads[self.worker] = mine
        return end


def _worker(args, queue, conn, parent: int) -> None:
    """A forked worker: decodes what it takes from the shared queue, sends each finished list back, then
    what its loop spent (``DecodeStats``). It dies with ``parent`` (the pid that forked it)."""
    from evalgate.lifetime import die_with_parent

    die_with_parent(parent)
    try:
        spent: list[DecodeStats] = []
        decode = _decode_slots if _slot_decoding(args[0], args[5]) else _decode_queue
        for finished in decode(*args, queue, spent):
            conn.send(("items", finished))
        conn.send(("done", spent[0] if spent else None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        try:
            import traceback

            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001 - the parent is gone
            pass
        sys.exit(1)
    finally:
        conn.close()


def _parallel(args, order: list[int], workers: int, stats: list | None = None, costs: Costs | None = None):
    """``workers`` processes forked from this one decode from one queue (the model is shared copy-on-write;
    each keeps its own thread count). This process only passes their lists on, as they arrive, so the
    workers are alike: none shares its GIL with the caller's scorer thread. A row's tokens do not depend on
    which process decoded it beside which others."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = _SharedQueue(order, ctx, workers, costs)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer's pool does not survive a fork
    children = []
    try:
        for _ in range(workers):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, args=(args, queue.of_worker(len(children)), send, os.getpid()), daemon=True,
                               name="evalgate-decode")
            proc.start()
            send.close()
            children.append([proc, receive, False])
        yield from _drain(children, stats)
    finally:
        for proc, receive, _ in children:
            if proc.is_alive():
                proc.terminate()
            proc.join()
            receive.close()


def _drain(children: list, stats: list | None = None):
    """Each worker's lists as they arrive, until every worker has said it is done (and ``stats`` has what
    each one spent)."""
    from multiprocessing.connection import wait

    while True:
        open_ = {id(child[1]): child for child in children if not child[2]}
        if not open_:
            return
        for receive in wait([child[1] for child in open_.values()]):
            child = open_[id(receive)]
            proc = child[0]
            try:
                kind, value = receive.recv()
            except EOFError:
                raise RuntimeError(f"a decoding worker (pid {proc.pid}) died without reporting (exit code "
                                   f"{proc.exitcode})") from None
            if kind == "items":
                yield value
            elif kind == "done":
                child[2] = True
                if stats is not None and value is not None:
                    stats.append(value)
            else:
                raise RuntimeError(f"a decoding worker failed: {value}")


def _dynamic(model, enc, max_new_tokens) -> bool:
    """Whether rows may leave and join the batch: canonical numerics, and either per-row slots (compressed
    attention) or a cache of plain dynamic layers with every row shorter than the sliding window (beyond it
    the window would count a row's padding)."""
    if _canonical(model) and _slot_decoding(model, "cpu"):  # slots: any device, rows of any length
        return True
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    longest = max(len(e) + m for e, m in zip(enc, max_new_tokens))
    return _canonical(model) and (window is None or longest < window - 1) and _spliceable(model)


PREFILL_PADDING = 0.15  # a prompt joins a prefill group while it is at least 85% as long as the group's longest


def _distinct(group: list[int], enc) -> tuple[list[int], list[int] | None]:
    """The first of each distinct prompt in ``group``, and for every member the position of its prompt among
    them (None when all differ)."""
    seen: dict[tuple, int] = {}
    of = [seen.setdefault(tuple(enc[i]), len(seen)) for i in group]
    if len(seen) == len(group):
        return group, None
    unique = [i for j, i in enumerate(group) if of[j] not in of[:j]]  # in the order of ``of``'s values
    return unique, of


def _like_lengths(take: list[int], enc) -> list[list[int]]:
    """``take``, longest prompt first, cut into groups of like length, each prefilled as one batch: a pad
    token costs as much as a real one, a call costs little."""
    groups: list[list[int]] = []
    for i in sorted(take, key=lambda i: -len(enc[i])):
        if groups and len(enc[i]) >= (1 - PREFILL_PADDING) * len(enc[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _canonical(model) -> bool:
    """Whether the model's rows are batch-invariant (``invariant.install``): only then may rows leave and join."""
    from evalgate.model_adapters.canonical.invariant import numerics

    return numerics(model) != "native"


# A static batch (PyTorch's numerics) is prefilled in calls of at most this many tokens, pads included: at
# batch 256 with 8-shot prompts one call would hold every prompt's activations at once.
PREFILL_TOKENS = 16384


def _prefill_in_parts(model, ids: list[list[int]], pad_id: int, device):
    """``_prefill`` of a static batch, a few rows per call when all of them would exceed ``PREFILL_TOKENS``:
    every call is left-padded to the batch's width, so the calls' caches share one timeline and stack into
    the cache one call would have built (``cache.stack_rows``)."""
    from evalgate.model_adapters.hf.cache import model_stackable, stack_rows

    width = max(len(e) for e in ids)
    rows = max(1, PREFILL_TOKENS // width)
    if len(ids) <= rows or not model_stackable(model):  # a cache this does not know: one call
        return _prefill(model, ids, pad_id, device)
    parts = [_prefill(model, ids[r:r + rows], pad_id, device, width) for r in range(0, len(ids), rows)]
    pasts = [state[0] for _, state in parts]
    mask = torch.cat([state[1] for _, state in parts])
    positions = torch.cat([state[2] for _, state in parts])
    return torch.cat([logits for logits, _ in parts]), (stack_rows(pasts), mask, positions, None)


def _prefill(model, ids: list[list[int]], pad_id: int, device, width: int | None = None):
    """The prompts as one batch left-padded to ``width`` (default: the longest): (last-position logits [k, V]
    FP32, state)."""
    k, width = len(ids), width or max(len(e) for e in ids)
    input_ids = torch.full((k, width), pad_id, dtype=torch.long)
    mask = torch.zeros((k, width), dtype=torch.long)
    for i, e in enumerate(ids):  # left padding: real tokens end at the right edge
        input_ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
        mask[i, width - len(e):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float(), (out.past_key_values, mask, positions[:, -1:], None)


def _choose(logits: torch.Tensor, rows: list[_Row], keys) -> list[int]:
    """Each row's next token: argmax, or for a sampled row the keyed sample at its own position."""
    chosen = logits.argmax(-1)
    if keys:
        by_step: dict[int, list[int]] = {}
        for j, r in enumerate(rows):
            if not r.done and keys[r.index] is not None:
                by_step.setdefault(len(r.generated), []).append(j)
        for step, js in by_step.items():
            picked = next_tokens(logits[js], [keys[rows[j].index] for j in js], step)
            chosen[js] = picked
    return chosen.tolist()


def _advance(r: _Row, tok: int, tokenizer, eos_ids: set, stops: tuple[str, ...], max_new: int) -> None:
    r.generated.append(tok)
    if tok in eos_ids:  # EOS is not part of the response text
        r.done, r.reason = True, "stop"
        r.text = tokenizer.decode(r.generated[:-1], skip_special_tokens=True)
        return
    text = tokenizer.decode(r.generated, skip_special_tokens=True)
    cut, hit = cut_at_stop(text, stops)
    if hit is not None:
        r.done, r.reason, r.hit, r.text = True, "stop", hit, cut
    elif len(r.generated) >= max_new:
        r.done, r.text = True, text


# --- splicing the KV cache along the batch ---------------------------------------------------------------


def _layers(past):
    return getattr(past, "layers", None)


def _plain_layer(layer) -> bool:
    """A plain dynamic cache layer (keys and values [B, H, T, D] and a length), which rows can leave and join."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)


def _spliceable(model) -> bool:
    """Whether the model's cache is made of plain dynamic layers."""
    from transformers.cache_utils import DynamicCache

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read: no splicing
        return False
    return bool(layers) and all(_plain_layer(layer) for layer in layers)


def _check_layers(past) -> list:
    layers = _layers(past)
    if not layers or any(not _plain_layer(layer) or not layer.is_initialized
                         or getattr(layer, "record_past", False) for layer in layers):
        raise RuntimeError("continuous batching met a KV cache it cannot splice; decode with batch_size=None")
    return layers


def _set_length(layer) -> None:
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = layer.keys.shape[-2]


def _select(state, keep: list[int]):
    """The state of the rows ``keep`` only, without the leading columns none of them attends to."""
    past, mask, last_pos, last_tok = state
    index = torch.tensor(keep, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, index)
    opened = mask.any(0).nonzero()
    cut = int(opened[0]) if len(opened) else 0
    mask = mask[:, cut:]
    for layer in _check_layers(past):
        layer.keys = layer.keys[:, :, cut:].index_select(0, index)
        layer.values = layer.values[:, :, cut:].index_select(0, index)
        kept = layer.__dict__.get("_evalgate_kv")  # invariant.KeptOperands
        if kept is not None:
            kept.select(index, cut)
        _set_length(layer)
    return past, mask, last_pos.index_select(0, index), None if last_tok is None else last_tok.index_select(0, index)


def _join(state, new):
    """Two states side by side along the batch, the shorter one left-padded (masked keys: exact zeros)."""
    past, mask, last_pos, last_tok = state
    past2, mask2, last_pos2, _ = new
    from evalgate.model_adapters.canonical.invariant import stack_left_padded

    t = max(mask.shape[-1], mask2.shape[-1])
    mask = stack_left_padded(mask, mask2, 1, t, 0)
    for layer, other in zip(_check_layers(past), _check_layers(past2)):
        a, b = t - layer.keys.shape[-2], t - other.keys.shape[-2]
        layer.keys = stack_left_padded(layer.keys, other.keys, 2, t, 0)
        layer.values = stack_left_padded(layer.values, other.values, 2, t, 0)
        mine, theirs = layer.__dict__.get("_evalgate_kv"), other.__dict__.get("_evalgate_kv")
        if mine is not None and theirs is not None:  # invariant.KeptOperands
            mine.join(theirs, a, b)
        else:
            layer.__dict__.pop("_evalgate_kv", None)  # rebuilt from the full cache on the next step
        _set_length(layer)
    return past, mask, torch.cat([last_pos, last_pos2]), last_tok


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]
