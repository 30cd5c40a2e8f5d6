"""Decoding DeepSeek-V4 from a KV cache preallocated per row ("slot").

transformers' DeepSeek-V4 cache grows by concatenation (every step copies each layer's window; every
compressed entry is a ``torch.cat``), and it keeps one timeline for the whole batch: a left-padded row's
compressor windows are cut along the padded timeline, so its compressed entries depend on its padding. Here
every row owns a slot with its own timeline, written in place:

- the sliding window: a ring of ``sliding_window`` keys (K = V), the key of position p at p mod window;
- an HCA / CSA compressor: the raw keys and gates of the window being filled (ring of ``compress_rate``), the
  compressed entries emitted so far (one per closed window, at their index), and for CSA the previous
  window's first-half ("Ca") keys and gates, which the next entry overlaps (two buffers, by the parity of the
  window: a step reads one and writes the other, so running a step twice writes what running it once does);
- a CSA layer's indexer: the same state at its own width, and its entries, which pick the top-k compressed
  entries each query attends to.

A decoding step (``SlotCache`` passed as ``past_key_values``, one token per row) writes each row's new key
and compressor input at its own position, closes the windows of the rows whose token completes one, and
attends over the row's window and its selected entries. A prompt is prefilled alone by the model's own
forward (no padding) and its cache is moved into a free slot (``SlotCache.admit``); a finished row's slot is
taken by the next prompt. So a row's tokens do not depend on its neighbours' timelines as a padded batch's do.

The arithmetic follows the model's numerics. With PyTorch's (``native``) a window is pooled and a row
attends with eager's operations (``attention._attend``), and RoPE is transformers' or, where
``triton_layers.install`` bound its kernels, one Triton kernel each, and so are a compressor's step
(``triton_compressor.compressor_step``, which pools only the rows that close a window) and the attention
(``triton_attention.decode_attention``, reading the ring and the entries in place): a row computes what it
would compute alone up to the floating-point order of its own sums, and PyTorch's matrix products can round
differently at different batch sizes on a GPU. With canonical numerics (``invariant.install``) they are
``invariant_compressed.pool`` and ``attend``, and every projection is canonical: a row's logits are those of
a prefill of its whole sequence, bit for bit, whatever the batch and the other slots.
"""

from __future__ import annotations

import types

import torch

from evalgate.model_adapters.canonical import invariant_compressed
from evalgate.model_adapters.fast.attention import _attend


def native_pool(module, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """transformers' pooling of a window: kv, gate [..., W, D] -> the normalised entry [..., D]."""
    return module.kv_norm((kv * gate.softmax(dim=-2, dtype=torch.float32).to(kv.dtype)).sum(dim=-2))


def native_attend(attn, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """eager's attention of one query per row (``attention._attend``)."""
    return _attend(attn, query, keys, mask, attn.scaling)


def transformers_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb(x, cos, sign * sin)``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    return apply_rotary_pos_emb(x, cos, sin if sign > 0 else -sin)


def rope_tail_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """``transformers_rope`` in place: only the trailing rope channels are rotated (transformers' arithmetic on
    that slice, so the same bits) and written back; the rest of ``x`` is not copied. Returns ``x``."""
    rope = x[..., -2 * cos.shape[-1]:]
    rope.copy_(transformers_rope(rope, cos, sin, sign))
    return x


def _triton_or(failed: list[str], what: str, kernel, fallback):
    """``kernel()``; where Triton fails to build or launch it (a first step, before any CUDA graph holds it),
    ``fallback()`` from then on: ``failed`` remembers why, and a warning says ``what`` runs instead."""
    if not failed:
        try:
            return kernel()
        except Exception as exc:  # noqa: BLE001  (a Triton build or launch error)
            import warnings

            failed.append(str(exc))
            warnings.warn(f"{what}: its Triton kernel failed ({exc})", stacklevel=3)
    return fallback()


_ROPE_FAILED: list[str] = []  # why the Triton RoPE could not run here, once it failed


def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """The same as one Triton kernel (``triton_layers.rope_step``), or transformers' rotation where it fails."""
    from evalgate.model_adapters.fast.triton_layers import rope_step

    return _triton_or(_ROPE_FAILED, "RoPE on transformers' rotation", lambda: rope_step(x, cos, sin, sign),
                      lambda: transformers_rope(x, cos, sin, sign))


# ``SlotCache.prefill``: tokens of one row a call, and of all rows a call (pads included); the attention's
# scores of a call are [rows, heads, chunk, window + chunk + entries]
PREFILL_CHUNK = 256
PREFILL_BUDGET = 8192


class _Compressed:
    """One compressor's (or indexer's) state for every slot: ``rate`` raw keys and gates of the window being
    filled, ``capacity`` entries (+1 column where rows that close no window write), and for an overlapping
    (CSA) compressor the previous window's Ca keys and gates (zero keys, -inf gates before the first)."""

    def __init__(self, module, slots: int, capacity: int, device):
        self.rate, self.width = module.compress_rate, module.head_dim
        self.overlap = type(module).__name__ != "DeepseekV4HCACompressor"
        dtype, gate_dtype = module.kv_proj.weight.dtype, module.gate_proj.weight.dtype  # what the projections give
        feed = 2 * self.width if self.overlap else self.width
        self.kv = torch.zeros(slots, self.rate, feed, dtype=dtype, device=device)
        self.gate = torch.zeros(slots, self.rate, feed, dtype=gate_dtype, device=device)
        self.entries = torch.zeros(slots, capacity + 1, self.width, dtype=dtype, device=device)
        self.capacity = capacity
        self.index = torch.arange(capacity + 1, device=device)  # entry indices, for the closed-entry mask
        self.rope_table = None  # cos, sin of every entry's first position (triton_compressor.rope_table)
        if self.overlap:  # [slot, parity of the window whose Ca it is, ...]
            self.prev_kv = torch.zeros(slots, 2, self.rate, self.width, dtype=dtype, device=device)
            self.prev_gate = torch.full((slots, 2, self.rate, self.width), float("-inf"), dtype=gate_dtype,
                                        device=device)

    def admit(self, slot: int, layer, name: str, length: int) -> None:
        """A row of ``length`` tokens, prefilled alone: transformers' cache layer state for ``name``."""
        count = layer.entry_count[name]
        if count > self.capacity:
            raise ValueError(f"a prompt of {length} tokens overflows the {self.capacity} compressed entries")
        if count:
            self.entries[slot, :count] = layer.compressed_kv[name][0]
        rest = layer.buffer_kv[name]
        if rest is not None and rest.shape[1]:
            at = torch.arange(length - rest.shape[1], length, device=self.kv.device) % self.rate
            self.kv[slot, at] = rest[0].to(self.kv.dtype)
            self.gate[slot, at] = layer.buffer_gate[name][0].to(self.gate.dtype)
        if self.overlap:  # the Ca of window count - 1 (none before the first: zero keys, -inf gates)
            prior = layer.overlap_kv[name]
            self.prev_kv[slot] = 0
            self.prev_gate[slot] = float("-inf")
            if prior is not None:
                self.prev_kv[slot, (count + 1) % 2] = prior[0].to(self.prev_kv.dtype)
                self.prev_gate[slot, (count + 1) % 2] = layer.overlap_gate[name][0].to(self.prev_gate.dtype)

    def reset(self, slot: int) -> None:
        """No window closed yet (a row starting at position 0): no previous Ca (zero keys, -inf gates)."""
        if self.overlap:
            self.prev_kv[slot] = 0
            self.prev_gate[slot] = float("-inf")

    def copy(self, src: int, dst: int) -> None:
        for t in self._tensors():
            t[dst] = t[src]

    def _tensors(self) -> list[torch.Tensor]:
        return [self.kv, self.gate, self.entries] + ([self.prev_kv, self.prev_gate] if self.overlap else [])

    def chunk(self, module, rows, start, counts, kv, gate, pool=native_pool) -> None:
        """Write each row's next ``counts`` tokens (kv, gate [b, C, feed], the first at position ``start``, [b])
        and pool every window they close, as ``step`` would one token at a time: the row's timeline from the
        start of its open window (the ring's tokens, then the chunk's) cut into windows of ``rate`` absolute
        positions, each closed one pooled (CSA: with the previous window's Ca) into the entry of its index."""
        b, width = kv.shape[:2]
        rate, feed = self.rate, kv.shape[-1]
        offset, first = start % rate, start // rate  # tokens of the open window in the ring; its index
        n = (rate - 1 + width) // rate + 1  # windows the timeline can touch, one spare
        t = torch.arange(n * rate, device=kv.device).unsqueeze(0)
        at = torch.where(t < offset.unsqueeze(1), t, rate + t - offset.unsqueeze(1)).clamp(max=rate + width - 1)
        at = at.unsqueeze(-1).expand(-1, -1, feed)
        line_kv = torch.cat([self.kv[rows], kv.to(self.kv.dtype)], 1).gather(1, at).view(b, n, rate, feed)
        raw_gate = torch.cat([self.gate[rows], gate.to(self.gate.dtype)], 1).gather(1, at).view(b, n, rate, feed)
        line_gate = raw_gate + module.position_bias
        window_kv, window_gate = line_kv, line_gate
        if self.overlap:  # window w: the Ca of window w - 1 (the stored one for the first), then its own Cb
            d = self.width
            parity = (first - 1) % 2
            prior_kv = self.prev_kv[rows, parity].unsqueeze(1).to(line_kv.dtype)
            prior_gate = self.prev_gate[rows, parity].unsqueeze(1).to(line_gate.dtype)
            ca_kv = torch.cat([prior_kv, line_kv[:, :-1, :, :d]], 1)
            ca_gate = torch.cat([prior_gate, line_gate[:, :-1, :, :d]], 1)
            window_kv = torch.cat([ca_kv, line_kv[..., d:]], 2)
            window_gate = torch.cat([ca_gate, line_gate[..., d:]], 2)
        entry = pool(module, window_kv, window_gate)  # [b, n, D]
        index = first.unsqueeze(1) + torch.arange(n, device=kv.device).unsqueeze(0)  # each window's entry
        cos, sin = module.rotary_emb(entry, position_ids=index * rate, layer_type=module.rope_layer_type)
        entry = transformers_rope(entry.unsqueeze(1), cos, sin).squeeze(1)
        closed = (torch.arange(1, n + 1, device=kv.device).unsqueeze(0) * rate) <= (offset + counts).unsqueeze(1)
        where = torch.where(closed, index, torch.full_like(index, self.capacity))
        self.entries[rows.unsqueeze(1).expand(-1, n), where] = entry.to(self.entries.dtype)
        last = (offset + counts) // rate  # the window left open: its tokens so far go back into the ring
        row = torch.arange(b, device=kv.device)
        self.kv[rows] = line_kv[row, last]
        self.gate[rows] = raw_gate[row, last]
        if self.overlap:  # the Ca of the last window closed here, at the parity of its index
            shut = (last - 1).clamp(min=0)
            parity = (first + last - 1) % 2
            keep = (last >= 1).view(-1, 1, 1)
            self.prev_kv[rows, parity] = torch.where(keep, line_kv[row, shut, :, :d].to(self.prev_kv.dtype),
                                                     self.prev_kv[rows, parity])
            self.prev_gate[rows, parity] = torch.where(keep, line_gate[row, shut, :, :d].to(self.prev_gate.dtype),
                                                       self.prev_gate[rows, parity])

    def fused_step(self, module, rows, positions, kv, gate) -> torch.Tensor:
        """``step`` with PyTorch's numerics as one Triton kernel (``triton_compressor``), which pools only the
        rows that close a window."""
        from evalgate.model_adapters.fast import triton_compressor

        if self.rope_table is None:
            self.rope_table = triton_compressor.rope_table(module, self.entries, self.capacity)
        return triton_compressor.compressor_step(self, module, rows, positions, kv, gate, *self.rope_table)

    def step(self, module, rows, positions, kv, gate, pool=native_pool, rope=transformers_rope) -> torch.Tensor:
        """Write one token per row (kv, gate [b, feed] at ``positions`` [b]); rows whose token closes a
        window get its entry (``pool``ed). Returns how many entries each row has now [b]. Reads nothing it
        writes, so a step run again with the same inputs leaves the same state."""
        at = positions % self.rate
        self.kv[rows, at] = kv.to(self.kv.dtype)
        self.gate[rows, at] = gate.to(self.gate.dtype)
        closing = (positions + 1) % self.rate == 0
        count = (positions + 1) // self.rate
        window_kv = self.kv[rows].unsqueeze(1)  # [b, 1, rate, feed]
        window_gate = self.gate[rows].unsqueeze(1) + module.position_bias
        if self.overlap:  # transformers' layout: the previous window's Ca, then this window's Cb
            d = self.width
            read, write = count % 2, (count + 1) % 2  # window count - 1 closes: Ca of count - 2 in, its own out
            window_kv = torch.cat([self.prev_kv[rows, read].unsqueeze(1).to(window_kv.dtype), window_kv[..., d:]],
                                  dim=2)
            prev_gate = self.prev_gate[rows, read].unsqueeze(1).to(window_gate.dtype)
            new_prev_kv, new_prev_gate = self.kv[rows][..., :d], window_gate[:, 0, :, :d]
            window_gate = torch.cat([prev_gate, window_gate[..., d:]], dim=2)
        entry = pool(module, window_kv, window_gate)
        first = ((count - 1).clamp(min=0) * self.rate).unsqueeze(1)  # the window's first position
        cos, sin = module.rotary_emb(entry, position_ids=first, layer_type=module.rope_layer_type)
        entry = rope(entry.unsqueeze(1), cos, sin).squeeze(1)[:, 0]
        where = torch.where(closing, count - 1, torch.full_like(count, self.capacity))
        self.entries[rows, where] = entry.to(self.entries.dtype)
        if self.overlap:
            keep = closing.view(-1, 1, 1)
            self.prev_kv[rows, write] = torch.where(keep, new_prev_kv.to(self.prev_kv.dtype),
                                                    self.prev_kv[rows, write])
            self.prev_gate[rows, write] = torch.where(keep, new_prev_gate.to(self.prev_gate.dtype),
                                                      self.prev_gate[rows, write])
        return count


class _LayerSlots:
    """One attention layer's slots: the sliding window's ring of keys, and its compressor's (and indexer's)
    state for a CSA / HCA layer."""

    def __init__(self, attn, slots: int, max_length: int):
        self.window = attn.sliding_window
        weight = attn.kv_proj.weight
        device = weight.device
        self.keys = torch.zeros(slots, self.window, attn.head_dim, dtype=weight.dtype, device=device)
        self.compressor = self.indexer = None
        compressor = attn.compressor
        if compressor is not None:
            capacity = max_length // compressor.compress_rate
            self.compressor = _Compressed(compressor, slots, capacity, device)
            indexer = getattr(compressor, "indexer", None)
            # an indexer whose top k covers every entry a slot can hold selects all the closed ones: its
            # scores decide nothing, so it keeps no state and takes no step (8-shot GSM8K in DeepSeek-V4-Flash:
            # at most 2,047 tokens a slot, 511 entries, top 512)
            if indexer is not None and capacity + 1 > indexer.index_topk:
                self.indexer = _Compressed(indexer, slots, capacity, device)

    def parts(self) -> list:
        return [x for x in (self.compressor, self.indexer) if x is not None]

    def reset(self, slot: int) -> None:
        for x in self.parts():
            x.reset(slot)

    def copy(self, src: int, dst: int) -> None:
        self.keys[dst] = self.keys[src]
        for x in self.parts():
            x.copy(src, dst)

    def admit(self, slot: int, layer, length: int) -> None:
        kept = layer.keys[0, 0]  # the last min(length, window - 1) keys
        at = torch.arange(length - kept.shape[0], length, device=self.keys.device) % self.window
        self.keys[slot, at] = kept.to(self.keys.dtype)
        if self.compressor is not None:
            self.compressor.admit(slot, layer, "compressor", length)
        if self.indexer is not None:
            self.indexer.admit(slot, layer, "indexer", length)


class SlotCache:
    """Per-row KV state of a DeepSeek-V4 model for ``slots`` rows of up to ``max_length`` tokens each,
    allocated once. ``admit`` moves a prompt's prefill cache into a slot; a decoding step is
    ``model(input_ids [b, 1], position_ids [b, 1], attention_mask=SlotCache.NO_MASK, past_key_values=cache)``
    after ``cache.rows = <slot indices of those b rows>`` (``decode_step`` does all of this). ``spare`` more
    slots (indices ``slots`` on) are never admitted: a CUDA-graphed step's padding rows write there."""

    NO_MASK = {"slots": None}  # transformers then builds no mask: each row's own state says what it sees

    def __init__(self, model, slots: int, max_length: int, spare: int = 0):
        from evalgate.model_adapters.canonical.invariant import numerics

        install(model)
        self.model = model
        self.native = numerics(model) == "native"
        self.pool = native_pool if self.native else invariant_compressed.pool
        self.attend = native_attend if self.native else invariant_compressed.attend
        self.follow_model()
        attns = [layer.self_attn for layer in model.model.layers]
        self.layers = [_LayerSlots(a, slots + spare, max_length) for a in attns]
        self.positions = torch.zeros(slots + spare, dtype=torch.long, device=attns[0].kv_proj.weight.device)
        self.lengths = [0] * (slots + spare)  # the positions on the host: checked without a sync
        self.slots, self.max_length = slots, max_length
        self.rows: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None  # during ``prefill``: each row's tokens in the call
        self.prefill_calls = self.prefill_tokens = 0  # what ``prefill`` computed (pads included)

    def follow_model(self) -> None:
        """RoPE, the compressors' steps and attention as Triton kernels where ``triton_layers.install`` marked
        the model (PyTorch's numerics on a GPU), else transformers' rotation, PyTorch's compressor step and the
        gathered attention; again after the mark changes (a benchmark comparing both)."""
        fused = self.native and getattr(self.model, "_evalgate_triton_layers", False)
        self.rope = fused_rope if fused else transformers_rope
        self.fused_attention = fused  # triton_attention.decode_attention, where the head fits its tile
        self.fused_compressor = fused  # triton_compressor.compressor_step, where the width fits

    def admit(self, slot: int, past, length: int) -> None:
        """A prompt of ``length`` tokens prefilled alone (batch 1, no padding) with transformers' cache
        ``past`` now decodes in ``slot``; whatever the slot held before is overwritten."""
        if length >= self.max_length:
            raise ValueError(f"a prompt of {length} tokens leaves no room in slots of {self.max_length}")
        for state, layer in zip(self.layers, past.layers):
            state.admit(slot, layer, length)
        self.positions[slot] = length
        self.lengths[slot] = length

    def start(self, slot: int) -> None:
        """``slot`` holds a row at position 0 (``prefill`` feeds its prompt from there)."""
        for state in self.layers:
            state.reset(slot)
        self.positions[slot] = 0
        self.lengths[slot] = 0

    def copy(self, src: int, dst: int) -> None:
        """``dst`` holds what ``src`` holds: a prompt's shared prefix, or a whole prompt, computed once."""
        for state in self.layers:
            state.copy(src, dst)
        self.positions[dst] = self.positions[src]
        self.lengths[dst] = self.lengths[src]

    def prefill(self, rows: list[int], prompts: list[list[int]], chunk: int | None = None,
                budget: int | None = None) -> torch.Tensor:
        """Feed each slot of ``rows`` its tokens of ``prompts`` from the slot's position on (0 after ``start``,
        a prefix's length after ``copy``), many rows a call: up to ``chunk`` tokens of each row and ``budget``
        tokens (pads included) a call, rows of like length together. Returns the logits [len(rows), V] after
        each row's last token. With canonical numerics a token's logits and state are those of a prefill of
        the row's whole sequence alone, bit for bit, whatever was fed beside it and in what chunks."""
        chunk, budget = chunk or PREFILL_CHUNK, budget or PREFILL_BUDGET
        if any(not p for p in prompts):
            raise ValueError("a slot's prefill needs at least one token")
        if len(set(rows)) != len(rows):
            raise ValueError("a slot appears twice in one prefill")
        for r, p in zip(rows, prompts):
            if self.lengths[r] + len(p) >= self.max_length:
                raise ValueError(f"a prompt of {self.lengths[r] + len(p)} tokens leaves no room in slots of "
                                 f"{self.max_length}")
        fed, logits = [0] * len(rows), [None] * len(rows)
        while True:
            todo = sorted((j for j in range(len(rows)) if fed[j] < len(prompts[j])),
                          key=lambda j: fed[j] - len(prompts[j]))
            if not todo:
                return torch.stack(logits)
            while todo:
                width = min(chunk, len(prompts[todo[0]]) - fed[todo[0]])
                group, todo = todo[:max(1, budget // width)], todo[max(1, budget // width):]
                parts = [prompts[j][fed[j]:fed[j] + width] for j in group]
                out = self.forward_chunk([rows[j] for j in group], parts)
                self.prefill_calls += 1
                self.prefill_tokens += len(group) * width
                for j, part, row_logits in zip(group, parts, out):
                    fed[j] += len(part)
                    if fed[j] == len(prompts[j]):
                        logits[j] = row_logits

    def forward_chunk(self, rows: list[int], parts: list[list[int]]) -> torch.Tensor:
        """One call of ``prefill``: each slot's tokens ``parts`` (right-padded to the longest) at its own next
        positions; the slots move on by their tokens. Returns the logits [b, V] after each row's last token."""
        device = self.positions.device
        width = max(map(len, parts))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for j, part in enumerate(parts):
            ids[j, :len(part)] = torch.tensor(part, dtype=torch.long)
        counts = torch.tensor(list(map(len, parts)), device=device)
        rows_t = torch.tensor(rows, device=device)
        positions = self.positions[rows_t].unsqueeze(1) + torch.arange(width, device=device).unsqueeze(0)
        self.rows, self.counts = rows_t, counts
        try:
            hidden = self.model.model(input_ids=ids.to(device), position_ids=positions, attention_mask=self.NO_MASK,
                                      past_key_values=self, use_cache=True).last_hidden_state
        finally:
            self.counts = None
        last = hidden[torch.arange(len(rows), device=hidden.device), counts.to(hidden.device) - 1]
        logits = self.model.lm_head(last.unsqueeze(1))[:, 0]
        self.positions[rows_t] += counts
        for r, part in zip(rows, parts):
            self.lengths[r] += len(part)
        return logits

    def decode_step(self, tokens: torch.Tensor, rows) -> torch.Tensor:
        """One token for each slot of ``rows`` ([b] long tensor, or a list): the logits [b, V] of the next
        token."""
        host = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        rows = torch.as_tensor(rows, device=self.positions.device)
        self.check(host)
        logits = self.forward(tokens, rows)
        self.advance(rows, host)
        return logits

    def check(self, rows: list[int]) -> None:
        if max(self.lengths[r] for r in rows) >= self.max_length:
            raise ValueError(f"a row reached the slots' {self.max_length} tokens")

    def forward(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The step's logits [b, V] for ``rows`` at their positions, without moving them on: no host sync,
        and run twice it leaves the state it leaves once."""
        self.rows = rows
        out = self.model(input_ids=tokens.view(-1, 1), position_ids=self.positions[rows].unsqueeze(1),
                         attention_mask=self.NO_MASK, past_key_values=self, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def advance(self, rows: torch.Tensor, host: list[int]) -> None:
        """``rows`` (on the device, and ``host`` the same on the host) are one token further."""
        self.positions[rows] += 1
        for r in host:
            self.lengths[r] += 1


def _step_attention(self, hidden_states, position_embeddings, position_ids, cache: SlotCache):
    """DeepseekV4Attention.forward for one token per row, from and into the rows' slots."""
    state = cache.layers[self.layer_idx]
    positions = position_ids[:, 0]
    rows = cache.rows.to(positions.device)  # the layer's device, over several GPUs
    b = hidden_states.shape[0]
    hidden_shape = (b, 1, -1, self.head_dim)
    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_norm(self.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2))
    q = cache.rope(q, cos, sin)
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
    kv = cache.rope(kv, cos, sin)  # [b, 1, 1, D]
    state.keys[rows, positions % state.window] = kv[:, 0, 0].to(state.keys.dtype)
    chosen = None
    if self.compressor is not None:
        chosen = _compressed_step(self, cache, state, rows, positions, hidden_states, q_residual, position_ids)
    out = _attend_step(self, cache, q, state, rows, positions, chosen)
    out = cache.rope(out, cos, sin, -1.0)
    grouped = out.transpose(1, 2).reshape(b, 1, self.config.o_groups, -1)
    return self.o_b_proj(self.o_a_proj(grouped).flatten(2)), None


def _chunk_attention(self, hidden_states, position_embeddings, position_ids, cache: SlotCache):
    """DeepseekV4Attention.forward for a chunk of tokens per row (``SlotCache.prefill``): hidden_states
    [b, C, hidden], row i's first ``cache.counts[i]`` of them real, at positions ``position_ids`` [b, C] that
    go on from the row's slot. A query attends to the keys of its window (the ring's, read before this
    chunk's are written, then the chunk's own up to it) and to the entries its position has closed (CSA: the
    indexer's top k of them), which are exactly the keys a prefill of the row's whole sequence opens to it."""
    state = cache.layers[self.layer_idx]
    rows, counts = cache.rows.to(position_ids.device), cache.counts.to(position_ids.device)
    start = position_ids[:, 0]
    b, width = hidden_states.shape[:2]
    hidden_shape = (b, width, -1, self.head_dim)
    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    # normed per (token, head) before the transpose, and rotated in place: no copy of the [b, C, H, D] queries
    q = rope_tail_(self.q_b_norm(self.q_b_proj(q_residual).view(*hidden_shape)).transpose(1, 2), cos, sin)
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
    kv = transformers_rope(kv, cos, sin)[:, 0]  # [b, C, D]
    window = state.window
    ring = state.keys[rows]  # before this chunk writes: the row's last ``window`` keys
    slot = torch.arange(window, device=rows.device).unsqueeze(0)
    held = start.unsqueeze(1) - 1 - (start.unsqueeze(1) - 1 - slot) % window  # the position each ring slot holds
    open_ = [(held.unsqueeze(1) >= 0) & (held.unsqueeze(1) > position_ids.unsqueeze(2) - window)]
    j = torch.arange(width, device=rows.device)
    mine = (j.unsqueeze(0) <= j.unsqueeze(1)) & (j.unsqueeze(0) > j.unsqueeze(1) - window)  # the chunk's own keys
    open_.append(mine.unsqueeze(0).expand(b, -1, -1))
    keys = [ring, kv.to(ring.dtype)]
    if self.compressor is not None:
        chosen = _compressed_chunk(self, cache, state, rows, start, counts, hidden_states, q_residual, position_ids)
        keys.append(state.compressor.entries[rows].to(ring.dtype))
        open_.append(chosen)
    # the chunk's keys into the ring: each row's last ``window`` real ones (a position's slot is written once)
    write = (j.unsqueeze(0) < counts.unsqueeze(1)) & (j.unsqueeze(0) >= counts.unsqueeze(1) - window)
    where = write.nonzero(as_tuple=True)
    state.keys[rows[where[0]], position_ids[where] % window] = kv[where].to(state.keys.dtype)
    open_ = torch.cat(open_, dim=-1)
    out = _attend_chunk(self, cache, q, torch.cat(keys, dim=1), open_)  # [b, H, C, D], its own tensor
    grouped = rope_tail_(out, cos, sin, -1.0).transpose(1, 2).reshape(b, width, self.config.o_groups, -1)
    return self.o_b_proj(self.o_a_proj(grouped).flatten(2)), None


def additive_mask(opened: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """eager's additive mask of a bool one: 0 where open, the dtype's lowest value where shut."""
    return torch.zeros(opened.shape, dtype=dtype, device=opened.device).masked_fill_(~opened, torch.finfo(dtype).min)


def _attend_chunk(self, cache: SlotCache, q, keys, opened):
    """A chunk's attention, [b, H, C, D]: query q [b, H, C, D] to keys [b, T, D] where opened [b, C, T]. One
    Triton kernel (``triton_attention.chunk_attention``: the scores never leave registers) where the cache
    follows the Triton mark and the head fits its tile, else (and from a Triton failure on) ``cache.attend``
    with an additive mask."""
    from evalgate.model_adapters.fast import triton_attention

    def masked():
        return cache.attend(self, q, keys.unsqueeze(1), additive_mask(opened, q.dtype).unsqueeze(1))

    if not cache.fused_attention or not triton_attention.supported(self.head_dim) or q.dtype != keys.dtype:
        return masked()
    return _triton_or(_CHUNK_ATTENTION_FAILED, "prefill attention on PyTorch's operations",
                      lambda: triton_attention.chunk_attention(q, keys, opened, self.sinks, self.scaling), masked)


_CHUNK_ATTENTION_FAILED: list[str] = []  # why the Triton prefill attention could not run here, once it failed


def _compressed_chunk(self, cache: SlotCache, state, rows, start, counts, hidden_states, q_residual, position_ids):
    """The compressor's (and CSA's indexer's) chunk: which of the row's entries each query attends to,
    [b, C, capacity + 1] bool: those its position has closed, for CSA the indexer's top k of them."""
    compressor = self.compressor
    kv, gate = compressor.kv_proj(hidden_states), compressor.gate_proj(hidden_states)
    state.compressor.chunk(compressor, rows, start, counts, kv, gate, cache.pool)
    index = state.compressor.index.view(1, 1, -1)
    closed = index < ((position_ids + 1) // compressor.compress_rate).unsqueeze(2)
    if state.indexer is None:
        return closed
    indexer = compressor.indexer
    kv, gate = indexer.kv_proj(hidden_states), indexer.gate_proj(hidden_states)
    state.indexer.chunk(indexer, rows, start, counts, kv, gate, cache.pool)
    b, width = hidden_states.shape[:2]
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(b, width, -1, indexer.head_dim).transpose(1, 2)
    q = transformers_rope(q, cos, sin).transpose(1, 2)
    scores = indexer.scorer(q, state.indexer.entries[rows], hidden_states)  # [b, C, capacity + 1]
    top = top_entries(scores.flatten(0, 1), closed.flatten(0, 1), indexer.index_topk)
    return top.view(b, width, -1)


_ATTENTION_FAILED: list[str] = []  # why the Triton attention could not run here, once it failed


def _attend_step(self, cache: SlotCache, q, state: _LayerSlots, rows, positions, chosen):
    """The step's attention, [b, H, 1, D]: one Triton kernel (``triton_attention.decode_attention``, reading
    the ring and the entries in place) where the cache follows the Triton mark and the head fits its tile
    (else, and from a Triton failure on, with a warning, the gathered form)."""
    from evalgate.model_adapters.fast import triton_attention

    def gathered():
        return _attend_gathered(self, cache, q, state, rows, positions, chosen)

    entries = None if chosen is None else state.compressor.entries
    dtypes = {q.dtype, state.keys.dtype} | ({entries.dtype} if entries is not None else set())
    if not cache.fused_attention or not triton_attention.supported(self.head_dim) or len(dtypes) > 1:
        return gathered()
    return _triton_or(_ATTENTION_FAILED, "slot attention on PyTorch's operations",
                      lambda: triton_attention.decode_attention(q, state.keys, rows, positions, entries, chosen,
                                                                self.sinks, self.scaling),
                      gathered)


def _attend_gathered(self, cache: SlotCache, q, state: _LayerSlots, rows, positions, chosen):
    """The step's attention with the rows' ring keys and entries gathered and joined, and an additive mask
    (``cache.attend``): [b, H, 1, D]."""
    b = q.shape[0]
    keys = state.keys[rows]  # [b, window, D]
    slots = torch.arange(state.window, device=keys.device)
    open_ = slots.unsqueeze(0) <= positions.unsqueeze(1)  # a slot of the ring is written once p reaches it
    if chosen is not None:
        keys = torch.cat([keys, state.compressor.entries[rows].to(keys.dtype)], dim=1)
        open_ = torch.cat([open_, chosen], dim=1)
    return cache.attend(self, q, keys.unsqueeze(1), additive_mask(open_, q.dtype).view(b, 1, 1, -1))


def _compressed_step(self, cache: SlotCache, state: _LayerSlots, rows, positions, hidden_states, q_residual,
                     position_ids):
    """The compressor's (and for CSA the indexer's) step: which of the row's entries
    (``state.compressor.entries[row]``, [capacity + 1, D]) it attends to, [b, capacity + 1] bool: the closed
    windows, for CSA only the indexer's top k of them."""
    compressor = self.compressor
    flat = hidden_states[:, 0]
    count = _window_step(cache, state.compressor, compressor, rows, positions, flat)
    closed = state.compressor.index.unsqueeze(0) < count.unsqueeze(1)  # the spare last column is never closed
    if state.indexer is None:  # HCA, or a top k that takes every closed entry
        return closed
    indexer = compressor.indexer
    _window_step(cache, state.indexer, indexer, rows, positions, flat)
    keys = state.indexer.entries[rows]  # [b, capacity + 1, d]
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(len(rows), 1, -1, indexer.head_dim).transpose(1, 2)
    q = cache.rope(q, cos, sin).transpose(1, 2)
    scores = indexer.scorer(q, keys, hidden_states)[:, 0]  # [b, capacity + 1]
    return top_entries(scores, closed, indexer.index_topk)


_COMPRESSOR_FAILED: list[str] = []  # why the Triton compressor step could not run here, once it failed


def _window_step(cache: SlotCache, state: _Compressed, module, rows, positions, flat) -> torch.Tensor:
    """A compressor's (or indexer's) step from the rows' hidden states ``flat`` [b, hidden]: one Triton kernel
    where the cache follows the Triton mark and the width fits it (else, and from a Triton failure on,
    PyTorch's operations). Returns each row's entry count [b]."""
    from evalgate.model_adapters.fast import triton_compressor

    kv, gate = module.kv_proj(flat), module.gate_proj(flat)

    def torch_step():
        return state.step(module, rows, positions, kv, gate, cache.pool, cache.rope)

    if cache.fused_compressor and triton_compressor.supported(state):
        return _triton_or(_COMPRESSOR_FAILED, "the compressor's step on PyTorch's operations",
                          lambda: state.fused_step(module, rows, positions, kv, gate), torch_step)
    return torch_step()


def top_entries(scores: torch.Tensor, closed: torch.Tensor, k: int) -> torch.Tensor:
    """[b, T] bool: each row's ``k`` closed entries of the highest scores, ties to the lower index (ReLU
    scores tie at exactly 0 often; transformers leaves the order of ties to ``torch.topk``)."""
    order = scores.masked_fill(~closed, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    top = order[:, :min(k, scores.shape[1])]
    return torch.zeros_like(closed).scatter_(1, top, True) & closed


def install(model) -> None:
    """Each attention layer decodes from a ``SlotCache`` when handed one, and runs transformers' own
    forward otherwise (a prefill)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    for layer in model.model.layers:
        attn = layer.self_attn
        if getattr(attn, "_evalgate_slots", False):
            continue
        native = attn.forward

        def forward(self, hidden_states, position_embeddings, position_ids, attention_mask, past_key_values=None,
                    _native=native, **kwargs):
            if isinstance(past_key_values, SlotCache) and past_key_values.counts is not None:
                return _chunk_attention(self, hidden_states, position_embeddings, position_ids, past_key_values)
            if isinstance(past_key_values, SlotCache):
                return _step_attention(self, hidden_states, position_embeddings, position_ids, past_key_values)
            return _native(hidden_states, position_embeddings, position_ids, attention_mask, past_key_values, **kwargs)

        assert isinstance(attn, DeepseekV4Attention)
        attn.forward = types.MethodType(forward, attn)
        attn._evalgate_slots = True
