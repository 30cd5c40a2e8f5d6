"""A forward pass whose tokens do not depend on the batch, the thread count or the CPU's instruction set.

``install(model)`` gives a DeepSeek-V4 model (the canary, the tiny test models, any ``DeepseekV4ForCausalLM``:
sliding-window, CSA and HCA attention) canonical numerics in every module, so that an item's logits, and hence its
greedy tokens, are a function of the item alone (docs/kernels.md#canonical-numerics):

- every matrix product (projections, router, hyper-connection mixes, attention scores and values, the
  output head) is ``canonical.fixed_matmul``; every reduction (RMSNorm, softmax denominators) is
  ``canonical.fixed_sum`` or, over a dimension the model fixes (streams, top-k slots), ``ordered_sum``;
  every exp, sigmoid, SiLU, softplus, cos and sin is correctly rounded to FP32; top-k is a stable sort;
- attention during prefill runs one sequence and one block of queries at a time over the keys its mask
  lets it see: masked keys contribute exact zeros, so the result is the batched one, without the work on
  padding;
- the routed experts are the selected kernel, whose accumulation is exact (``kernels/exact.py``); the
  ``bf16`` reference kernel switches to canonical matmuls on a module that carries the flag set here;
- the RoPE inverse frequencies (default and YaRN), computed with ``pow`` when the model was built, are
  recomputed correctly rounded;
- CSA / HCA layers: the compressors' window pooling and the indexer's scores and top-k are canonical too
  (``invariant_compressed.py``); a batch of such a model decodes from per-row slots (``attention_slots``),
  because transformers' compressors cut windows along a padded batch's common timeline.

It binds forwards to module instances (nothing in transformers changes; other models are untouched) and
refuses a module it does not know, so an operation without a canonical definition cannot slip in.
Elementwise +, -, *, /, comparisons, gathers and dtype conversions are left to PyTorch: they are correctly
rounded IEEE operations and reproducible already (sqrt and rsqrt are not on every PyTorch build, so they are
canonical too).
"""

from __future__ import annotations

import types
import weakref

import numpy as np
import torch
from torch import nn

from evalgate.kernels import canonical
from evalgate.kernels.canonical import FixedOperand, fixed_matmul, fixed_operand, ordered_sum
from evalgate.model_adapters.canonical.blocks import attend as _attend
from evalgate.model_adapters.canonical.blocks import fused_linear as _fused_linear
from evalgate.model_adapters.canonical.blocks import weight_operand as _weight_operand
from evalgate.model_adapters.canonical.fp8_linear import is_fp8

NUMERICS = canonical.VERSION
ATTENTION = "evalgate_canonical"
QUERY_BLOCK = 128  # prefill attention: queries per block


# --- modules ----------------------------------------------------------------------------------------


def linear_forward(self, x):
    """``canonical.linear``, its weight's grid cached on the module (built once from an FP8 weight's codes)."""
    b = _weight_operand(self, "linear", (self,), lambda ws: fixed_operand(ws[0].t(), "columns"))
    dtype = torch.promote_types(x.dtype, self._evalgate_dtype if is_fp8(self) else self.weight.dtype)
    out = fixed_matmul(x.reshape(-1, x.shape[-1]), b, dtype, self.bias)
    return out.reshape(*x.shape[:-1], self.out_features)


def grouped_linear_forward(self, x):
    input_shape, hidden_dim = x.shape[:-2], x.shape[-1]
    w = _weight_operand(self, "grouped", (self,), lambda ws: fixed_operand(
        ws[0].view(self.n_groups, -1, hidden_dim).transpose(1, 2), "columns"))
    x = x.reshape(-1, self.n_groups, hidden_dim).transpose(0, 1)
    y = fixed_matmul(x, w, x.dtype).transpose(0, 1)
    return y.reshape(*input_shape, self.n_groups, -1)


def _mean_square(h: torch.Tensor) -> torch.Tensor:
    """Mean of squares over the last dim, FP32 (squares exact in float64, canonical sum)."""
    h64 = h.to(torch.float64)
    squares = h64.square_() if h64 is not h else h64.square()  # in place on the copy, never on the caller's
    return canonical.fixed_mean(squares, -1, keepdim=True, nonnegative=True).to(torch.float32)


def rms_norm_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * canonical.rsqrt(_mean_square(h) + self.variance_epsilon)
    return (self.weight * h).to(input_dtype)


def unweighted_rms_norm_forward(self, x):
    return x * canonical.rsqrt(_mean_square(x.float()) + self.eps).to(x.dtype)


def rotary_forward(self, x, position_ids, layer_type=None):
    inv_freq = getattr(self, f"{layer_type}_inv_freq")
    scaling = getattr(self, f"{layer_type}_attention_scaling")
    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    return (canonical.cos(freqs) * scaling).to(x.dtype), (canonical.sin(freqs) * scaling).to(x.dtype)


def canonical_inv_freq(config, layer_type: str) -> torch.Tensor:
    """transformers' default RoPE inverse frequencies, 1 / base^(i/dim), with base^t correctly rounded."""
    params = config.rope_parameters[layer_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    t = torch.arange(0, dim, 2, dtype=torch.float) / dim
    return 1.0 / canonical.power(float(params["rope_theta"]), t)


def _stream_sum(hc: int):
    """Sums over the hc streams (keepdim, FP32): with two streams PyTorch's own sum is the one correctly
    rounded sum (the Sinkhorn loop calls it 4 x 19 times per module), otherwise ``ordered_sum``."""
    if hc <= 2:
        return lambda t, dim: t.sum(dim=dim, keepdim=True)
    return lambda t, dim: ordered_sum(t, dim, keepdim=True)


def _sinkhorn_2x2(e_comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The Sinkhorn loop of ``hyper_connection_forward`` for two streams on the CPU, bit for bit: the same
    FP32 operations (a row's or a column's sum of two terms is one rounded add, then + eps in FP32, then one
    division), in place in NumPy. On [B, 1, 2, 2] the torch loop's ~120 calls per module are all dispatch
    overhead; a NumPy call costs a fraction of one."""
    e = e_comb.numpy()
    with np.errstate(all="ignore"):  # overflow and 0/0 give inf and NaN silently, as in torch
        eps32 = np.float32(eps)  # what torch makes of the Python float beside an FP32 tensor
        c = np.empty(e.shape, np.float32)
        np.divide(e, e[..., :, 0:1] + e[..., :, 1:2], out=c)
        c += eps32
        rows, cols = np.empty(c.shape[:-1] + (1,), np.float32), np.empty(c.shape[:-2] + (1, 2), np.float32)
        r0, r1, c0, c1 = c[..., :, 0:1], c[..., :, 1:2], c[..., 0:1, :], c[..., 1:2, :]  # views: follow c
        np.add(c0, c1, out=cols)
        cols += eps32
        c /= cols
        for _ in range(iters - 1):
            np.add(r0, r1, out=rows)
            rows += eps32
            c /= rows
            np.add(c0, c1, out=cols)
            cols += eps32
            c /= cols
    return torch.from_numpy(c)


def hyper_connection_forward(self, hidden_streams):
    batch_size, seq_len = hidden_streams.shape[:2]
    hc = self.hc_mult
    flattened = self.input_norm(hidden_streams.view(batch_size, seq_len, -1).float())
    flattened = canonical.linear(flattened, self.fn, owner=self, out_dtype=torch.float32)
    pre_w, post_w, comb_w = flattened.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
    pre_scale, post_scale, comb_scale = self.scale.unbind(0)
    comb_z = comb_w.view(*comb_w.shape[:-1], hc, hc) * comb_scale + comb_b.view(hc, hc)
    comb_z = comb_z - comb_z.amax(dim=-1, keepdim=True)
    # sigmoid(pre), sigmoid(post) and softmax(comb) as PyTorch computes them, over one canonical exp
    e = canonical.exp(torch.cat([-(pre_w * pre_scale + pre_b), -(post_w * post_scale + post_b),
                                 comb_z.flatten(-2)], dim=-1))
    e_pre, e_post, e_comb = e.split([hc, hc, hc * hc], dim=-1)
    pre = 1.0 / (1.0 + e_pre) + self.hc_eps
    post = 2 * (1.0 / (1.0 + e_post))
    e_comb = e_comb.view(*comb_z.shape)
    if hc == 2 and e_comb.device.type == "cpu" and not e_comb.requires_grad:
        comb = _sinkhorn_2x2(e_comb, self.hc_sinkhorn_iters, self.hc_eps)
    else:
        total = _stream_sum(hc)
        comb = e_comb / total(e_comb, -1) + self.hc_eps
        comb = comb / (total(comb, -2) + self.hc_eps)
        for _ in range(self.hc_sinkhorn_iters - 1):
            comb = comb / (total(comb, -1) + self.hc_eps)
            comb = comb / (total(comb, -2) + self.hc_eps)
    collapsed = ordered_sum(pre.unsqueeze(-1) * hidden_streams, 2).to(hidden_streams.dtype)
    return post, comb, collapsed


def hyper_head_forward(self, x):
    flat = self.input_norm(x.flatten(2).float())
    mixes = canonical.linear(flat, self.hc_fn, owner=self, out_dtype=torch.float32)
    pre = canonical.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
    return ordered_sum(pre.unsqueeze(-1) * x, 2).to(x.dtype)


def mlp_forward(self, x):
    gate, up = _fused_linear(self, "gate_up", x, (self.gate_proj, self.up_proj))
    gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
    return self.down_proj(canonical.silu(gate).to(gate.dtype) * up)


def _scores(router, logits):
    kind = type(router.score_fn).__name__
    if kind == "SqrtSoftplusActivation":
        return canonical.sqrt(canonical.softplus(logits).to(logits.dtype)).to(logits.dtype)
    if kind == "Sigmoid":
        return canonical.sigmoid(logits).to(logits.dtype)
    raise NotImplementedError(f"no canonical form of the router score function {kind}")


def _normalise(router, weights):
    weights = weights / (ordered_sum(weights, -1, keepdim=True).to(weights.dtype) + 1e-20)
    return weights * router.routed_scaling_factor


def topk_router_forward(self, hidden_states):
    logits = canonical.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight, owner=self)
    scores = _scores(self, logits)
    indices = canonical.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1)[1]
    return logits, _normalise(self, scores.gather(1, indices)), indices


def hash_router_forward(self, hidden_states, input_ids):
    logits = canonical.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight, owner=self)
    scores = _scores(self, logits)
    indices = self.tid2eid[input_ids.reshape(-1)].long()
    return logits, _normalise(self, scores.gather(1, indices)), indices


def moe_block_forward(self, hidden_states, input_ids=None):
    """DeepseekV4SparseMoeBlock.forward with the router's and the shared expert's projections of the same
    input as one canonical matmul (the routed experts are the kernel's)."""
    batch, seq_len, hidden_dim = hidden_states.shape
    flat = hidden_states.view(-1, hidden_dim)
    router, shared = self.gate, self.shared_experts
    logits, gate, up = _fused_linear(self, "router_shared", flat, (router, shared.gate_proj, shared.up_proj))
    scores = _scores(router, logits)
    if self.is_hash:
        indices = router.tid2eid[input_ids.reshape(-1)].long()
    else:
        indices = canonical.topk(scores + router.e_score_correction_bias, router.top_k, dim=-1)[1]
    routed = self.experts(flat, indices, _normalise(router, scores.gather(1, indices)))
    gate, up = gate.clamp(max=shared.limit), up.clamp(min=-shared.limit, max=shared.limit)
    out = shared.down_proj(canonical.silu(gate).to(gate.dtype) * up)
    return (routed + out).view(batch, seq_len, hidden_dim)


def _mix_streams(comb, hidden_states):
    """``torch.matmul(comb.to(dtype).T, hidden_states)`` over the streams: exact products, added in stream
    order in FP32, rounded once to the streams' dtype."""
    dtype = hidden_states.dtype
    terms = comb.to(dtype).float().transpose(-1, -2).unsqueeze(-1) * hidden_states.float().unsqueeze(-3)
    return ordered_sum(terms, -2).to(dtype)


def decoder_layer_forward(self, hidden_states, input_ids=None, **kwargs):
    dtype = hidden_states.dtype
    post, comb, collapsed = self.attn_hc(hidden_states)
    attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
    hidden_states = post.to(dtype).unsqueeze(-1) * attn_output.unsqueeze(-2) + _mix_streams(comb, hidden_states)
    post, comb, collapsed = self.ffn_hc(hidden_states)
    mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
    return post.to(dtype).unsqueeze(-1) * mlp_output.unsqueeze(-2) + _mix_streams(comb, hidden_states)


# --- attention ----------------------------------------------------------------------------------------


def attention_forward(self, hidden_states, position_embeddings, position_ids, attention_mask, past_key_values=None,
                      **kwargs):
    """DeepseekV4Attention.forward (shared-KV MQA, sinks, grouped output) with canonical attention. For a
    sliding-window layer the keys' and values' fixed-point grids are kept beside the KV cache and extended by
    the new keys only (a key's grid depends on that key alone); a CSA / HCA layer appends its compressor's
    entries to the window's keys and their block bias to the mask (``invariant_compressed``)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings[self.rope_layer_type]
    q_a, kv = _fused_linear(self, "q_a_kv", hidden_states, (self.q_a_proj, self.kv_proj))
    q_residual = self.q_a_norm(q_a)
    q = self.q_b_norm(self.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2))
    q = apply_rotary_pos_emb(q, cos, sin)
    kv = self.kv_norm(kv).view(*hidden_shape).transpose(1, 2)
    kv = apply_rotary_pos_emb(kv, cos, sin)
    if self.compressor is not None:
        if past_key_values is not None:
            kv = past_key_values.update(kv, kv, self.layer_idx)[0]
        entries, block_bias = self.compressor(hidden_states, q_residual, position_ids, past_key_values, self.layer_idx)
        kv = torch.cat([kv, entries.to(kv.dtype)], dim=2)  # fresh grids: the entries change from call to call
        keys, values = fixed_operand(kv.transpose(-1, -2), "columns"), fixed_operand(kv, "rows")
        if isinstance(attention_mask, torch.Tensor) and block_bias is not None:
            attention_mask = torch.cat([attention_mask, block_bias.to(attention_mask.dtype)], dim=-1)
    else:
        keys, values = fixed_operand(kv.transpose(-1, -2), "columns"), fixed_operand(kv, "rows")
        if past_key_values is not None:
            full = past_key_values.update(kv, kv, self.layer_idx)[0]
            keys, values = _with_cache(past_key_values.layers[self.layer_idx], full, keys, values)
    if isinstance(attention_mask, torch.Tensor) and keys.q.shape[-1] > attention_mask.shape[-1]:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, keys.q.shape[-1] - attention_mask.shape[-1]))
    attn_output = canonical_attention(self, q, keys, values, attention_mask, self.scaling)
    attn_output = apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = self.o_a_proj(attn_output.reshape(*input_shape, self.config.o_groups, -1)).flatten(2)
    return self.o_b_proj(grouped), None


def _with_cache(layer, full, keys, values):
    """Keys and values operands for the cache's ``full`` keys: the ones kept from the last call plus the new
    ones, or all of ``full`` afresh when the cache is not the continuation of the last call."""
    kept = layer.__dict__.get("_evalgate_kv")
    new = keys.q.shape[-1]
    if kept is not None and kept.length + new == full.shape[-2] and kept.batch == full.shape[0]:
        kept.append(keys, values)
    else:
        if full.shape[-2] != new:
            keys, values = fixed_operand(full.transpose(-1, -2), "columns"), fixed_operand(full, "rows")
        kept = layer._evalgate_kv = KeptOperands(keys, values)
    keys, values = kept.operands()
    stays = layer.keys.shape[-2]  # what the cache layer keeps (a sliding window keeps a suffix)
    if stays != kept.length:
        layer._evalgate_kv = KeptOperands(keys.narrow(-1, kept.length - stays, stays),
                                          values.narrow(-2, kept.length - stays, stays))
    return keys, values


class KeptOperands:
    """The fixed-point operands of a cache layer's keys (columns of the scores' right operand) and values
    (rows of the output's), kept beside the cache in buffers with room to grow along the keys, so that a
    decoding step writes only its new key (each key's grid is its own) instead of copying the cache.

    Stored key-major, [row capacity, 1, key capacity, D] (scales [.., 1]); ``operands()`` are views of the
    first ``rows`` rows and the ``length`` keys from ``start`` on. ``select`` and ``join``
    (``generation.decode_stream``) let rows leave and join, in place where the buffers have room: a padding
    key has q = 0 (and scale 1), which a masked key multiplies by an exact zero."""

    GROW = 64  # spare keys allocated beyond the current length
    LEFT = 128  # spare keys before the first one, where a reallocation happens: a longer prompt joins in place
    PAD = (0.0, 1.0, 0.0, 0.0, 1.0)  # a padding key in each part: q 0, scale 1

    def __init__(self, keys: FixedOperand, values: FixedOperand, capacity: int | None = None):
        parts = self._parts(keys, values)
        self.length = parts[0].shape[2]
        self.rows = parts[0].shape[0]
        self._alloc(parts, capacity or self.length + self.GROW)

    @staticmethod
    def _parts(keys: FixedOperand, values: FixedOperand) -> list[torch.Tensor]:
        """key-major tensors: keys' q, scale, values; values' q, scale."""
        return [keys.q.transpose(-1, -2), keys.scale.transpose(-1, -2), keys.values.transpose(-1, -2),
                values.q, values.scale]

    def _alloc(self, parts: list[torch.Tensor], capacity: int, rows: int | None = None, left: int = 0) -> None:
        """New buffers of ``rows`` rows (default: the parts') and ``left`` + ``capacity`` keys, the parts from key
        ``left`` on (read only within the window ``start`` .. ``start + length`` and the first ``rows`` rows)."""
        self.bufs = []
        for t in parts:
            buf = t.new_empty(rows or t.shape[0], t.shape[1], left + capacity, t.shape[3])
            buf[:t.shape[0], :, left:left + t.shape[2]] = t
            self.bufs.append(buf)
        self.start = left

    @property
    def batch(self) -> int:
        return self.rows

    def _views(self) -> list[torch.Tensor]:
        return [b[:self.rows, :, self.start:self.start + self.length] for b in self.bufs]

    def operands(self) -> tuple[FixedOperand, FixedOperand]:
        kq, ks, kv, vq, vs = self._views()
        return (FixedOperand(kq.transpose(-1, -2), ks.transpose(-1, -2), "columns", kv.transpose(-1, -2)),
                FixedOperand(vq, vs, "rows"))

    def append(self, keys: FixedOperand, values: FixedOperand) -> None:
        parts = self._parts(keys, values)
        new = parts[0].shape[2]
        if self.start + self.length + new > self.bufs[0].shape[2]:
            self._alloc(self._views(), 2 * (self.length + new) + self.GROW, self.bufs[0].shape[0])
        end = self.start + self.length
        for buf, t in zip(self.bufs, parts):
            buf[:self.rows, :, end:end + new] = t
        self.length += new

    def select(self, index: torch.Tensor, cut: int) -> None:
        """Keep the rows ``index`` and drop the first ``cut`` keys, in place: the window starts ``cut`` keys later
        and only the rows that change place are copied (rows leaving a decoding batch: the ones after them)."""
        self.start += cut
        self.length -= cut
        keep = index.tolist()
        if len(keep) > self.bufs[0].shape[0]:  # more rows than the buffers hold (a prompt's samples repeated)
            self._alloc([v.index_select(0, index) for v in self._views()], self.length + self.GROW)
            self.rows = len(keep)
            return
        first = next((j for j, i in enumerate(keep) if i != j), len(keep))
        if first < len(keep):
            for v in (b[:, :, self.start:self.start + self.length] for b in self.bufs):
                v[first:len(keep)] = v.index_select(0, index[first:])  # read whole before written
        self.rows = len(keep)

    def join(self, other: "KeptOperands", pad_self: int, pad_other: int) -> None:
        """``other``'s rows after these, each left-padded to a common length: into the spare rows and the spare
        keys before the window where the buffers have them (only the new rows and the new padding written),
        else into new buffers with room for as many rows again and ``LEFT`` keys before the window."""
        length, rows = self.length + pad_self, self.rows + other.rows
        if rows > self.bufs[0].shape[0] or pad_self > self.start:
            grown = 2 * rows if rows > self.bufs[0].shape[0] else self.bufs[0].shape[0]
            self._alloc(self._views(), length + self.GROW, grown, self.LEFT + pad_self)
        self.start -= pad_self
        s = self.start
        for b, o, pad in zip(self.bufs, other._views(), self.PAD):
            b[:self.rows, :, s:s + pad_self] = pad
            b[self.rows:rows, :, s:s + pad_other] = pad
            b[self.rows:rows, :, s + pad_other:s + length] = o
        self.length, self.rows = length, rows


def stack_left_padded(a: torch.Tensor, b: torch.Tensor, dim: int, length: int, value: float,
                      capacity: int | None = None) -> torch.Tensor:
    """a's rows then b's (along dim 0), each left-padded with ``value`` along ``dim`` to ``length``, written
    once into a new tensor of ``capacity`` (default ``length``) along ``dim``; beyond ``length`` it is not
    written. Rows joining a decoding batch (``generation._join``, ``KeptOperands.join``)."""
    shape = list(a.shape)
    shape[0], shape[dim] = a.shape[0] + b.shape[0], capacity or length
    out = a.new_empty(shape)
    for rows, part in ((out.narrow(0, 0, a.shape[0]), a), (out.narrow(0, a.shape[0], b.shape[0]), b)):
        pad = length - part.shape[dim]
        rows.narrow(dim, 0, pad).fill_(value)
        rows.narrow(dim, pad, part.shape[dim]).copy_(part)
    return out


def canonical_attention(module, query, keys, values, attention_mask, scaling):
    """query [B, H, S, D]; keys/values operands of one KV head ([B, 1, D, T] / [B, 1, T, D]); attention_mask
    [B, 1, S, T] (0 or the dtype's minimum). Returns [B, S, H, D] like the eager attention function.

    A query's result depends on its own scores and the keys it sees only. During prefill each sequence
    and block of queries attends to the span of keys its mask leaves open; masked keys would add exact
    zeros, so skipping them changes nothing but the work."""
    b, _, s, _ = query.shape
    if s > 1 and attention_mask is None:
        raise NotImplementedError("canonical attention needs the 4D mask for more than one query")
    if s == 1:
        if attention_mask is None or b == 1 or attention_mask.shape[0] != b:
            return _attend(query, keys, values, attention_mask, module.sinks, scaling).transpose(1, 2).contiguous()
        out = torch.empty_like(query)
        for r0, r1, k0 in decode_segments(attention_mask):  # each run of rows over the keys it may see
            n = attention_mask.shape[-1] - k0
            out[r0:r1] = _attend(query[r0:r1], keys.narrow(0, r0, r1 - r0).narrow(-1, k0, n),
                                 values.narrow(0, r0, r1 - r0).narrow(-2, k0, n),
                                 attention_mask[r0:r1, :, :, k0:], module.sinks, scaling)
        return out.transpose(1, 2).contiguous()
    out = torch.zeros_like(query)
    open_ = attention_mask > torch.finfo(attention_mask.dtype).min / 2  # [B, 1, S, T]
    for i in range(b):
        mi = i if attention_mask.shape[0] > 1 else 0
        k_i, v_i = keys.narrow(0, i, 1), values.narrow(0, i, 1)
        for s0 in range(0, s, QUERY_BLOCK):
            s1 = min(s, s0 + QUERY_BLOCK)
            cols = open_[mi, :, s0:s1].any(dim=-2).any(dim=0).nonzero().flatten()
            if len(cols) == 0:
                continue  # every key masked: the sink takes all the weight, the output is exactly 0
            k0, n = int(cols[0]), int(cols[-1]) + 1 - int(cols[0])
            out[i:i + 1, :, s0:s1] = _attend(query[i:i + 1, :, s0:s1], k_i.narrow(-1, k0, n), v_i.narrow(-2, k0, n),
                                             attention_mask[mi:mi + 1, :, s0:s1, k0:k0 + n], module.sinks, scaling)
    return out.transpose(1, 2).contiguous()


# a decoding step's attention call costs about as much as this many (row, key) scores beside them (~0.4 ms
# against ~0.22 us a score of 4 heads, one CPU core): a run of rows is cut where that saves more than it costs
SEGMENT_COST = 1800
_last_segments: tuple = (None, [])  # (a weak reference to the last mask, its runs): every layer of a step shares it


def decode_segments(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive rows of a decoding step's mask [B, 1, 1, T] as (first row, end row, first key any
    of them sees): a left-padded batch holds rows of every prompt length, and a short row's padding keys are
    masked scores that add exact zeros. Consecutive rows only (views, no copies), cut where the scores a run
    skips outweigh the cost of one more call (``SEGMENT_COST``): the fewest (row, key) scores plus calls, by
    dynamic programming over the cut points, once per step."""
    global _last_segments
    ref, runs = _last_segments
    if ref is not None and ref() is mask:
        return runs
    t = mask.shape[-1]
    open_ = mask[:, 0, 0, :] > torch.finfo(mask.dtype).min / 2
    first = torch.where(open_.any(-1), open_.to(torch.int8).argmax(-1), t - 1).tolist()
    n = len(first)
    best, cut = [0] * (n + 1), [0] * (n + 1)
    for i in range(1, n + 1):  # best[i]: the cheapest cover of rows [0, i); cut[i]: where its last run starts
        low, choice, at = t, None, 0
        for j in range(i - 1, -1, -1):
            low = min(low, first[j])
            cost = best[j] + (i - j) * (t - low) + SEGMENT_COST
            if choice is None or cost < choice:
                choice, at = cost, j
        best[i], cut[i] = choice, at
    runs, i = [], n
    while i > 0:
        runs.append((cut[i], i, min(first[cut[i]:i])))
        i = cut[i]
    runs.reverse()
    _last_segments = (weakref.ref(mask), runs)
    return runs


def _refuse_attention_interface(*args, **kwargs):
    raise NotImplementedError("canonical attention runs inside the attention module's own forward")


def register_attention() -> None:
    """The model's masks are built as for eager attention (a 4D float mask); the interface function itself
    is never called, the attention modules' canonical forward attends."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTENTION, _refuse_attention_interface)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)


# --- installing ---------------------------------------------------------------------------------------


def _forwards():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    from evalgate.model_adapters.canonical import invariant_compressed as c

    return [  # subclasses before their bases (GroupedLinear is an nn.Linear)
        (m.DeepseekV4HCACompressor, c.hca_compressor_forward),
        (m.DeepseekV4CSACompressor, c.csa_compressor_forward),
        (m.DeepseekV4Indexer, c.indexer_forward),
        (m.DeepseekV4IndexerScorer, c.indexer_scorer_forward),
        (m.DeepseekV4GroupedLinear, grouped_linear_forward),
        (nn.Linear, linear_forward),
        (m.DeepseekV4RMSNorm, rms_norm_forward),
        (m.DeepseekV4UnweightedRMSNorm, unweighted_rms_norm_forward),
        (m.DeepseekV4RotaryEmbedding, rotary_forward),
        (m.DeepseekV4HyperConnection, hyper_connection_forward),
        (m.DeepseekV4HyperHead, hyper_head_forward),
        (m.DeepseekV4MLP, mlp_forward),
        (m.DeepseekV4TopKRouter, topk_router_forward),
        (m.DeepseekV4HashRouter, hash_router_forward),
        (m.DeepseekV4DecoderLayer, decoder_layer_forward),
        (m.DeepseekV4Attention, attention_forward),
        (m.DeepseekV4SparseMoeBlock, moe_block_forward),
    ]


def _kept():
    """Modules whose own forward is kept: it only calls other modules, the attention interface, the experts
    kernel, gathers, masks and elementwise IEEE operations (read in transformers 5.23)."""
    from transformers.activations import SiLUActivation, SqrtSoftplusActivation
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    return (m.DeepseekV4ForCausalLM, m.DeepseekV4Model, m.DeepseekV4Experts, nn.Embedding, nn.ModuleList,
            nn.Sigmoid, SiLUActivation, SqrtSoftplusActivation)


def install(model) -> None:
    """Give ``model`` canonical numerics (module docstring). Raises NotImplementedError, naming the module,
    for a module it has no canonical form of."""
    if getattr(model, "_evalgate_numerics", None) == NUMERICS:
        return
    if getattr(model.config, "model_type", None) != "deepseek_v4":
        raise NotImplementedError(f"canonical numerics cover DeepSeek-V4 models, not {model.config.model_type!r}")
    forwards, kept = _forwards(), _kept()
    plan = []
    for name, module in model.named_modules():
        fn = next((f for cls, f in forwards if isinstance(module, cls)), None)
        if fn is None and not isinstance(module, kept):
            raise NotImplementedError(f"no canonical forward for {name or 'the model'} ({type(module).__name__})")
        plan.append((name, module, fn))
    register_attention()
    for _name, module, fn in plan:
        if fn is not None:
            module.forward = types.MethodType(fn, module)
            module.__dict__.pop("_evalgate_slots", None)  # a slot decoder bound earlier wraps this forward again
        if type(module).__name__ == "DeepseekV4RotaryEmbedding":
            _canonical_rope(module)
        if type(module).__name__ == "DeepseekV4Experts":
            module._evalgate_canonical = True  # the bf16 reference kernel reads it
    model.config._attn_implementation = ATTENTION
    model._evalgate_numerics = NUMERICS


def _canonical_rope(rotary) -> None:
    from evalgate.model_adapters.canonical.invariant_compressed import yarn_inv_freq

    for layer_type in rotary.layer_types:
        kind = rotary.rope_type[layer_type]
        if kind not in ("default", "yarn"):
            raise NotImplementedError(f"RoPE type {kind!r} has no canonical form")
        inv = (canonical_inv_freq if kind == "default" else yarn_inv_freq)(rotary.config, layer_type)
        for attr in (f"{layer_type}_inv_freq", f"{layer_type}_original_inv_freq"):
            buf = getattr(rotary, attr)
            with torch.no_grad():
                buf.copy_(inv.to(device=buf.device, dtype=buf.dtype))


def numerics(model) -> str:
    """What the model computes with: ``canonical-v1`` once installed, else ``native`` (PyTorch's own)."""
    return getattr(model, "_evalgate_numerics", "native")
