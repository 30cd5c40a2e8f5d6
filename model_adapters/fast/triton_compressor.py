"""One decoding step of a DeepSeek-V4 compressor (HCA or CSA) over per-row slots as one Triton kernel, for
PyTorch's numerics on a GPU.

``attention_slots._Compressed.step`` with PyTorch's operations is about forty kernels a layer: the new key
and gate written into the window's ring, every row's window gathered, the previous window's half joined
(CSA), the gates biased, a softmax over the window, the gated sum, the norm, the RoPE table looked up and
applied, the entry and the overlap written back through ``torch.where``. It pools every row's window at
every step, though only a row whose token closes a window (one step in ``compress_rate``) keeps the result.
``compressor_step`` is one program per row: it writes the row's key and gate, and only if the row closes a
window pools it, normalises and rotates the entry and writes it (and for CSA the window's first half, which
the next entry overlaps).

The arithmetic is transformers' (``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor``, as
``attention_slots.native_pool`` and ``transformers_rope`` do it): the biased gates in their promoted dtype,
an FP32 softmax over the window rounded to the keys' dtype, each product rounded to it, the sum in FP32
rounded once, the RMS norm in FP32 times its FP32 weight rounded once, RoPE in FP32 on the rounded entry
with the cos / sin that ``rotary_emb`` gives at the window's first position. The order of the sums and
Triton's ``exp`` / ``rsqrt`` are the kernel's, so entries agree with the PyTorch step within float rounding,
not bit for bit (``tests/test_triton_compressor.py``, under Triton's interpreter on a CPU).
"""

from __future__ import annotations

import torch

WINDOW_BLOCK = 4096  # window rows x channel pairs a program holds per tile
ROUNDINGS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's _round kinds


def rope_table(module, entries: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [capacity, rope_dim / 2] of entry i (first position i * compress_rate), as ``rotary_emb``
    gives them for an entry of ``entries``' dtype: what ``_Compressed.step`` looks up in every step."""
    first = (torch.arange(max(capacity, 1), device=entries.device) * module.compress_rate).unsqueeze(0)
    cos, sin = module.rotary_emb(entries[:1, 0], position_ids=first, layer_type=module.rope_layer_type)
    return cos[0].contiguous(), sin[0].contiguous()


def compressor_step(state, module, rows: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                    gate: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``_Compressed.step`` (``state``, the compressor ``module``) for one token per row: kv, gate [b, feed]
    at ``positions`` [b] of slots ``rows`` [b]. Returns how many entries each row has now [b] (int64).
    A row that closes no window writes no entry (the PyTorch step writes its spare column, never read)."""
    from evalgate.model_adapters.fast.triton_compressor_kernel import compressor_step_kernel
    from evalgate.model_adapters.fast.triton_layers import _on_device

    b = rows.shape[0]
    count = torch.empty(b, dtype=torch.long, device=positions.device)
    if not b:
        return count
    d, rate, half = state.width, state.rate, cos.shape[-1]
    window = 2 * rate if state.overlap else rate
    pairs = d // 2
    bias = module.position_bias
    promoted = torch.promote_types(state.gate.dtype, bias.dtype)  # the biased gates' dtype, as PyTorch adds them
    prev_kv = state.prev_kv if state.overlap else state.kv  # never read without an overlap
    prev_gate = state.prev_gate if state.overlap else state.gate
    block = max(1, min(window, WINDOW_BLOCK // pairs))
    with _on_device(kv):
        compressor_step_kernel[(b,)](
            kv.contiguous(), gate.contiguous(), rows, positions, state.kv, state.gate, prev_kv, prev_gate,
            state.entries, bias.contiguous(), module.kv_norm.weight.contiguous(), cos, sin, count,
            float(module.kv_norm.variance_epsilon), R=rate, FEED=state.kv.shape[-1], D=d, CAP1=state.entries.shape[1],
            HALF=half, OVERLAP=state.overlap, WB=1 << (block.bit_length() - 1), WINDOW=window,
            ROUND_GATE=ROUNDINGS[promoted], PAIRS=pairs, OFF=d if state.overlap else 0,
            CA_ROWS=max(1, min(rate, 2 * WINDOW_BLOCK // d)))
    return count


def supported(state) -> bool:
    """The kernel holds a row's channels as pairs and its window in power-of-two tiles: a width whose half
    is a power of two, and a power-of-two rate."""
    pairs, rate = state.width // 2, state.rate
    return state.width % 2 == 0 and pairs >= 1 and pairs & (pairs - 1) == 0 and rate >= 1 and rate & (rate - 1) == 0
