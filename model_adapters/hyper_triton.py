"""DeepSeek-V4's hyper-connection weights as one Triton kernel, for PyTorch's numerics on a GPU.

``DeepseekV4HyperConnection.forward`` turns each token's projected mixes into the ``pre``, ``post`` and
``comb`` weights with a sigmoid, a softmax and a Sinkhorn loop of ``hc_sinkhorn_iters`` (20) row and column
normalisations over an hc x hc matrix (4 x 4 in DeepSeek-V4-Flash): about 120 kernels of a few elements per
token, twice a layer. Launched one after the other they cost a decoding step far more than their arithmetic,
at batch 1 and at batch 256 alike. ``hyper_weights`` computes all three for a block of tokens in registers,
one kernel; ``install`` binds it to every hyper-connection module of a model on a GPU that keeps PyTorch's
numerics (canonical numerics have their own forward, ``invariant.hyper_connection_forward``).

Same formulas and FP32 as transformers; the exponentials and the order of each 4-term sum are Triton's, so
results agree with transformers' within float rounding, not bit for bit (``tests/test_hyper_triton.py``,
under Triton's interpreter on a CPU).
"""

from __future__ import annotations

import types

import torch

ENABLED = True  # a switch for comparisons (benchmarks/dsv4_flash_fullwidth.py measures both)
BLOCK = 32  # tokens per program


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


_KERNEL = []


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
        import contextlib

        # Triton launches on the current device: a model spread over GPUs has layers on the others
        where = torch.cuda.device(flat.device) if flat.device.type == "cuda" else contextlib.nullcontext()
        with where:
            _KERNEL[0][(-(-n // BLOCK),)](flat, base.float().contiguous(), scale.float().contiguous(), pre, post,
                                          comb, n, eps, HC=hc, ITERS=iters, BLOCK=BLOCK)
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


def hyper_connection_forward(self, hidden_streams):
    """DeepseekV4HyperConnection.forward with ``hyper_weights``. Where Triton fails to build or launch the
    kernel (a first call, before any CUDA graph holds it), the module goes back to transformers' forward,
    with a warning."""
    import torch.nn.functional as F

    batch_size, seq_len = hidden_streams.shape[:2]
    flattened = self.input_norm(hidden_streams.view(batch_size, seq_len, -1).float())
    mixes = F.linear(flattened, self.fn.float())
    try:
        pre, post, comb = hyper_weights(mixes, self.base, self.scale, self.hc_mult, self.hc_sinkhorn_iters,
                                        self.hc_eps)
    except Exception as exc:  # noqa: BLE001  (a Triton build or launch error: the module's own forward serves)
        import warnings

        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

        warnings.warn(f"hyper-connection weights on transformers' forward: the Triton kernel failed ({exc})",
                      stacklevel=2)
        self.forward = types.MethodType(DeepseekV4HyperConnection.forward, self)
        return self.forward(hidden_streams)
    collapsed = (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)
    return post, comb, collapsed


def usable(model) -> str | None:
    """Why ``install`` leaves ``model`` alone, or None when it binds the kernel."""
    from evalgate.kernels.triton.availability import unavailable_reason
    from evalgate.model_adapters.invariant import numerics

    if not ENABLED:
        return "disabled"
    if numerics(model) != "native":
        return "canonical numerics have their own hyper-connections"
    hc = getattr(model.config, "hc_mult", 0)
    if hc < 1 or hc & (hc - 1):
        return f"hc_mult {hc} is not a power of two"
    device = next(model.parameters()).device.type
    return unavailable_reason(device) if device == "cuda" else "not on a GPU"


def install(model, force: bool = False) -> bool:
    """Bind ``hyper_connection_forward`` to every DeepseekV4HyperConnection of ``model`` where ``usable``, or
    anywhere with ``force`` (Triton's interpreter on a CPU, in tests). Returns whether it did."""
    if not force and usable(model) is not None:
        return False
    for module in model.modules():
        if type(module).__name__ == "DeepseekV4HyperConnection":
            module.forward = types.MethodType(hyper_connection_forward, module)
    return True
