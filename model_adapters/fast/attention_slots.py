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
    mask = torch.zeros(open_.shape, dtype=q.dtype, device=q.device).masked_fill_(~open_, torch.finfo(q.dtype).min)
    return cache.attend(self, q, keys.unsqueeze(1), mask.view(b, 1, 1, -1))


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
            if isinstance(past_key_values, SlotCache):
                return _step_attention(self, hidden_states, position_embeddings, position_ids, past_key_values)
            return _native(hidden_states, position_embeddings, position_ids, attention_mask, past_key_values, **kwargs)

        assert isinstance(attn, DeepseekV4Attention)
        attn.forward = types.MethodType(forward, attn)
        attn._evalgate_slots = True
