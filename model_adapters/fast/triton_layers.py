"""DeepSeek-V4 layers as Triton kernels, for PyTorch's numerics on a GPU: the hyper-connections (weights,
collapse, mixing), the RMSNorms and the step's rope.

A decoding step launches its kernels one after the other, and most of them hold a few elements per token,
so at batch 1 and at batch 256 alike a step costs far more than its arithmetic:

- ``DeepseekV4HyperConnection.forward`` turns each token's projected mixes into the ``pre``, ``post`` and
  ``comb`` weights with a sigmoid, a softmax and a Sinkhorn loop of ``hc_sinkhorn_iters`` (20) row and
  column normalisations over an hc x hc matrix (4 x 4 in DeepSeek-V4-Flash): about 120 kernels, twice a
  layer. ``hyper_weights`` computes all three for a block of tokens in registers, one kernel.
- transformers' RMSNorms (about nine a layer: the block norms, the query, key and compressor norms, the
  hyper-connections' input norms) take six to eight kernels each. ``rms_norm`` is one.
- ``apply_rotary_pos_emb`` (about a dozen kernels: the half-size cos / sin repeated, the rope slice cut,
  rotated, cast and joined back) runs six times a layer in a decoding step from slots. ``rope_step`` is one;
  ``attention_slots`` calls it where ``install`` marked the model.
- a prefill's hyper-connection mixes (the streams flattened to FP32, normed, an FP32 linear: three passes
  over [tokens, hc x hidden] FP32, 1.7 ms a call at 8,192 tokens on an H100) are one kernel reading the BF16
  streams once, ``hyper_mixes``; a decoding step (fewer than ``MIXES_ROWS`` tokens) keeps transformers' own.
- the streams' collapse (``pre``-weighted sum) and the layer's mixing (``post * output + comb^T @ streams``,
  twice a layer): four and five kernels, the matmul a generic batched GEMM (55 µs a call at 256 tokens on
  an H200). ``hyper_collapse`` and ``hyper_mix`` (``triton_hyper_kernel``) are one each; the decoder
  layer's forward (``decoder_layer_forward``) calls the second.

``install`` binds them to a model on a GPU that keeps PyTorch's numerics (canonical numerics have their own
forwards, ``invariant.py``). Same formulas, dtypes and roundings as transformers; the exponentials and the
order of each sum are Triton's, so results agree with transformers' within float rounding, not bit for bit
(``tests/test_triton_layers.py``, under Triton's interpreter on a CPU).
"""

from __future__ import annotations

import types

import torch

ENABLED = True  # a switch for comparisons (benchmarks/dsv4_flash_fullwidth.py measures both)
# hyper-connection weights: tokens per program and warps per program (a latency chain of 4 x 4 reductions at
# any batch). `benchmarks/bench_step_kernels.py --device cuda` on an H200: one warp of 8 tokens 3.4 µs a call
# at 1 and 256 tokens, 4 warps of 32 tokens 9.1-9.3 µs (one warp keeps a token's reductions in it)
HYPER = {"block": 8, "warps": 1}
NORM_BLOCK = 4096  # elements of a row per pass (RMSNorm)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def hyper_weights_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, n_rows, eps,
                             HC: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        width = (2 + HC) * HC
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < n_rows
        i = tl.arange(0, HC)
        pre_scale = tl.load(scale_ptr)
        post_scale = tl.load(scale_ptr + 1)
        comb_scale = tl.load(scale_ptr + 2)
        vec = rows[:, None] * width + i[None, :]
        pre_w = tl.load(mix_ptr + vec, mask=ok[:, None], other=0.0)
        post_w = tl.load(mix_ptr + vec + HC, mask=ok[:, None], other=0.0)
        pre = 1.0 / (1.0 + tl.exp(-(pre_w * pre_scale + tl.load(base_ptr + i)[None, :]))) + eps
        post = 2.0 * (1.0 / (1.0 + tl.exp(-(post_w * post_scale + tl.load(base_ptr + HC + i)[None, :]))))
        tl.store(pre_ptr + rows[:, None] * HC + i[None, :], pre, mask=ok[:, None])
        tl.store(post_ptr + rows[:, None] * HC + i[None, :], post, mask=ok[:, None])
        r = tl.arange(0, HC)[None, :, None]
        c = tl.arange(0, HC)[None, None, :]
        cell = r * HC + c
        z = tl.load(mix_ptr + rows[:, None, None] * width + 2 * HC + cell, mask=ok[:, None, None], other=0.0)
        z = z * comb_scale + tl.load(base_ptr + 2 * HC + cell)
        e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
        comb = e / tl.sum(e, axis=2)[:, :, None] + eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        for _ in tl.static_range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        tl.store(comb_ptr + rows[:, None, None] * HC * HC + cell, comb, mask=ok[:, None, None])

    return hyper_weights_kernel


def _norm_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, WIDTH: tl.constexpr, WEIGHTED: tl.constexpr,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * WIDTH
        cols = tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in tl.static_range(0, WIDTH, BLOCK):
            x = tl.load(x_ptr + row + start + cols, mask=start + cols < WIDTH, other=0.0).to(tl.float32)
            total += x * x
        r = 1.0 / tl.sqrt_rn(tl.sum(total, axis=0) / WIDTH + eps)
        if not WEIGHTED:  # transformers rounds the factor to the input's dtype, then multiplies in it
            r = r.to(out_ptr.dtype.element_ty).to(tl.float32)
        for start in tl.static_range(0, WIDTH, BLOCK):
            ok = start + cols < WIDTH
            x = tl.load(x_ptr + row + start + cols, mask=ok, other=0.0).to(tl.float32)
            if WEIGHTED:
                y = tl.load(w_ptr + start + cols, mask=ok, other=0.0).to(tl.float32) * (x * r)
            else:
                y = x * r
            tl.store(out_ptr + row + start + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    return rms_norm_kernel


def _rope_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_t, sxb, sxt, sxd, scb, ssb, SIGN: tl.constexpr,
                    D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        t = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        base = x_ptr + b.to(tl.int64) * sxb + t.to(tl.int64) * sxt
        x = tl.load(base + d * sxd, mask=ok, other=0.0)
        j = d - (D - 2 * HALF)  # the interleaved rope slice is the trailing 2 * HALF channels
        rope = ok & (j >= 0)
        odd = (j % 2) == 1
        partner = tl.where(odd, d - 1, d + 1)
        xp = tl.load(base + partner * sxd, mask=rope, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + b.to(tl.int64) * scb + j // 2, mask=rope, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + b.to(tl.int64) * ssb + j // 2, mask=rope, other=0.0).to(tl.float32) * SIGN
        y = x.to(tl.float32) * c + tl.where(odd, xp, -xp) * s  # rotate_half: (-x_odd, x_even) per pair
        out = tl.where(rope, y.to(out_ptr.dtype.element_ty), x)
        tl.store(out_ptr + (b.to(tl.int64) * n_t + t) * D + d, out, mask=ok)

    return rope_kernel


_KERNEL = []
_NORM_KERNEL = []
_ROPE_KERNEL = []


def rope_step(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb(x, cos, sign * sin)`` for one position per row: x [b, T, 1, D]
    (T heads), cos and sin [b, 1, D_rope / 2] -> [b, T, 1, D] in x's dtype, contiguous."""
    if not _ROPE_KERNEL:
        _ROPE_KERNEL.append(_rope_kernel())
    b, t, s, d = x.shape
    if s != 1 or cos.shape[1] != 1:
        raise ValueError(f"rope_step takes one position per row, not x {tuple(x.shape)}, cos {tuple(cos.shape)}")
    half = cos.shape[-1]
    out = torch.empty(b, t, 1, d, dtype=x.dtype, device=x.device)
    if b and t:
        with _on_device(x):
            _ROPE_KERNEL[0][(b, t)](x, cos, sin, out, t, x.stride(0), x.stride(1), x.stride(3), cos.stride(0),
                                    sin.stride(0), SIGN=sign, D=d, HALF=half, BLOCK_D=1 << max(0, d - 1).bit_length())
    return out


def _on_device(t: torch.Tensor):
    """Triton launches on the current device: a model spread over GPUs has layers on the others."""
    import contextlib

    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4RMSNorm (``weight``: FP32 x · rsqrt(mean x² + eps), times the weight in FP32,
    rounded once to x's dtype) or DeepseekV4UnweightedRMSNorm (``weight`` None: the factor rounded to x's
    dtype, times x in it) over the last dimension."""
    if not _NORM_KERNEL:
        _NORM_KERNEL.append(_norm_kernel())
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(flat)
    width = flat.shape[-1]
    block = min(NORM_BLOCK, 1 << max(0, width - 1).bit_length())
    if flat.shape[0]:
        with _on_device(flat):
            _NORM_KERNEL[0][(flat.shape[0],)](flat, flat if weight is None else weight.contiguous(), out, eps,
                                              WIDTH=width, WEIGHTED=weight is not None, BLOCK=block)
    return out.view(x.shape)


def _or_transformers(forward):
    """``forward`` bound to a module; where Triton fails to build or launch its kernel (a first call, before
    any CUDA graph holds it) the module goes back to its class's own forward, with a warning."""
    import functools

    @functools.wraps(forward)
    def guarded(self, *args):
        try:
            return forward(self, *args)
        except Exception as exc:  # noqa: BLE001  (a Triton build or launch error: transformers' forward serves)
            import warnings

            warnings.warn(f"{type(self).__name__} on transformers' forward: its Triton kernel failed ({exc})",
                          stacklevel=2)
            self.forward = types.MethodType(type(self).forward, self)
            return self.forward(*args)

    return guarded


@_or_transformers
def rms_norm_forward(self, hidden_states):
    """DeepseekV4RMSNorm.forward with ``rms_norm``."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


@_or_transformers
def unweighted_rms_norm_forward(self, x):
    """DeepseekV4UnweightedRMSNorm.forward with ``rms_norm``."""
    return rms_norm(x, None, self.eps)


def hyper_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float):
    """mixes [..., (2 + hc) * hc] FP32 (the flattened streams' projection), base [(2 + hc) * hc], scale [3] ->
    (pre [..., hc], post [..., hc], comb [..., hc, hc]) FP32, as ``DeepseekV4HyperConnection.forward``."""
    if not _KERNEL:
        _KERNEL.append(_kernel())
    lead = mixes.shape[:-1]
    flat = mixes.reshape(-1, mixes.shape[-1]).contiguous()
    n = flat.shape[0]
    pre = flat.new_empty(n, hc)
    post = flat.new_empty(n, hc)
    comb = flat.new_empty(n, hc, hc)
    if n:
        with _on_device(flat):
            block = HYPER["block"]
            _KERNEL[0][(-(-n // block),)](flat, base.float().contiguous(), scale.float().contiguous(), pre, post,
                                          comb, n, eps, HC=hc, ITERS=iters, BLOCK=block, num_warps=HYPER["warps"])
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


@_or_transformers
def hyper_connection_forward(self, hidden_streams):
    """DeepseekV4HyperConnection.forward with ``hyper_weights``."""
    import torch.nn.functional as F

    batch_size, seq_len = hidden_streams.shape[:2]
    if batch_size * seq_len >= MIXES_ROWS:  # a prefill: one kernel, one read of the streams
        mixes = hyper_mixes(hidden_streams, self.fn, self.input_norm.eps)
    else:
        flattened = self.input_norm(hidden_streams.view(batch_size, seq_len, -1).float())
        mixes = F.linear(flattened, self.fn.float())
    pre, post, comb = hyper_weights(mixes, self.base, self.scale, self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps)
    return post, comb, hyper_collapse(pre, hidden_streams)


MIX_BLOCK = 1024  # hidden positions per program (stream collapse and mixing)
# ``hyper_mixes`` from this many tokens a call (a prefill's): fewer leave its row blocks too few programs to
# fill the GPU, and a decoding step keeps transformers' three kernels (and their bits)
MIXES_ROWS = 512
# rows and inputs per tile, warps, the products' precision: `benchmarks/bench_step_kernels.py --device cuda`
# on an H100 at 8,192 tokens of 4 x 4096: 0.30 ms a call (transformers' norm and FP32 linear 1.70 ms; 32 x 128
# with 4 warps 0.61 ms; FP32 multiply-adds instead of TF32x3 1.30 ms)
MIXES = {"rows": 32, "k": 64, "warps": 2, "precision": "tf32x3"}
_MIX_FAILED: list[str] = []  # why the mixing kernels could not run here, once they failed


def _mixes_on_triton(streams: torch.Tensor) -> bool:
    return not _MIX_FAILED and streams.dtype in (torch.bfloat16, torch.float32) and streams.numel() > 0


def _token_streams(streams: torch.Tensor):
    """(streams as contiguous [tokens, hc, D], hc, D, the launch grid, BLOCK_D) for the mixing kernels."""
    hc, d = streams.shape[-2:]
    block = min(MIX_BLOCK, 1 << max(0, d - 1).bit_length())
    flat = streams.reshape(-1, hc, d).contiguous()
    return flat, hc, d, (flat.shape[0], -(-d // block)), block


def _mix_failed(exc: Exception) -> None:
    import warnings

    _MIX_FAILED.append(str(exc))
    warnings.warn(f"hyper-connection mixing on PyTorch's operations: its Triton kernel failed ({exc})", stacklevel=3)


def hyper_mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.linear(UnweightedRMSNorm(streams.flatten(-2).float()), fn.float())`` as one kernel
    (``hyper_mixes_kernel``): streams [b, s, hc, D], fn [N, hc * D] -> [b, s, N] FP32."""
    from evalgate.model_adapters.fast.triton_hyper_kernel import hyper_mixes_kernel

    b, s = streams.shape[:2]
    flat = streams.reshape(b * s, -1).contiguous()
    n, k = fn.shape
    if flat.shape[1] != k:
        raise ValueError(f"hyper_mixes: streams of {flat.shape[1]} per token against fn [{n}, {k}]")
    out = torch.empty(b * s, n, dtype=torch.float32, device=streams.device)
    with _on_device(flat):
        hyper_mixes_kernel[(-(-flat.shape[0] // MIXES["rows"]),)](
            flat, fn.float().contiguous(), out, flat.shape[0], eps, K=k, N=n, NP=max(16, 1 << max(0, n - 1).bit_length()),
            BM=MIXES["rows"], BK=MIXES["k"], PRECISION=MIXES["precision"], num_warps=MIXES["warps"])
    return out.view(b, s, n)


def hyper_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``(pre[..., None] * streams).sum(-2).to(streams.dtype)``: pre [..., hc] FP32, streams [..., hc, D]."""
    if _mixes_on_triton(streams):
        from evalgate.model_adapters.fast.triton_hyper_kernel import hyper_collapse_kernel

        flat, hc, d, grid, block = _token_streams(streams)
        out = torch.empty(flat.shape[0], d, dtype=streams.dtype, device=streams.device)
        try:
            with _on_device(flat):
                hyper_collapse_kernel[grid](
                    pre.reshape(-1, hc).float().contiguous(), flat, out, D=d, HC=hc, BLOCK_D=block,
                    BF16=streams.dtype == torch.bfloat16)
            return out.view(streams.shape[:-2] + (d,))
        except Exception as exc:  # noqa: BLE001  (a Triton build or launch error: PyTorch's operations serve)
            _mix_failed(exc)
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def hyper_mix(post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """A decoder layer's new streams, ``post.to(dtype)[..., None] * output[..., None, :] +
    comb.to(dtype)^T @ streams``: post [..., hc], comb [..., hc, hc] FP32, output [..., D], streams
    [..., hc, D]. The kernel's fallback is this expression, not the layer's forward: the layer's attention
    has written its cache by then."""
    if _mixes_on_triton(streams):
        from evalgate.model_adapters.fast.triton_hyper_kernel import hyper_mix_kernel

        flat, hc, d, grid, block = _token_streams(streams)
        out = torch.empty_like(flat)
        try:
            with _on_device(flat):
                hyper_mix_kernel[grid](
                    post.reshape(-1, hc).float().contiguous(), comb.reshape(-1, hc, hc).float().contiguous(),
                    output.reshape(-1, d).to(streams.dtype).contiguous(), flat, out, D=d, HC=hc, BLOCK_D=block,
                    BF16=streams.dtype == torch.bfloat16)
            return out.view(streams.shape)
        except Exception as exc:  # noqa: BLE001  (a Triton build or launch error: PyTorch's operations serve)
            _mix_failed(exc)
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def decoder_layer_forward(self, hidden_states, input_ids=None, **kwargs):
    """DeepseekV4DecoderLayer.forward (hidden_states: the [B, S, hc, hidden] streams) with ``hyper_mix``."""
    post, comb, collapsed = self.attn_hc(hidden_states)
    attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
    hidden_states = hyper_mix(post, comb, attn_output, hidden_states)
    post, comb, collapsed = self.ffn_hc(hidden_states)
    mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
    return hyper_mix(post, comb, mlp_output, hidden_states)


def usable(model) -> str | None:
    """Why ``install`` leaves ``model`` alone, or None when it binds the kernel."""
    from evalgate.kernels.triton.availability import unavailable_reason
    from evalgate.model_adapters.canonical.invariant import numerics

    if not ENABLED:
        return "disabled"
    if numerics(model) != "native":
        return "canonical numerics have their own forwards"
    hc = getattr(model.config, "hc_mult", 0)
    if hc < 1 or hc & (hc - 1):
        return f"hc_mult {hc} is not a power of two"
    device = next(model.parameters()).device.type
    return unavailable_reason(device) if device == "cuda" else "not on a GPU"


FORWARDS = {"DeepseekV4HyperConnection": hyper_connection_forward, "DeepseekV4RMSNorm": rms_norm_forward,
            "DeepseekV4UnweightedRMSNorm": unweighted_rms_norm_forward, "DeepseekV4DecoderLayer": decoder_layer_forward}


def install(model, force: bool = False) -> bool:
    """Bind ``FORWARDS`` to the modules of ``model`` where ``usable``, or anywhere with ``force`` (Triton's
    interpreter on a CPU, in tests). Returns whether it did."""
    if not force and usable(model) is not None:
        return False
    for module in model.modules():
        forward = FORWARDS.get(type(module).__name__)
        if forward is not None:
            module.forward = types.MethodType(forward, module)
    model._evalgate_triton_layers = True  # attention_slots takes rope_step then
    return True
