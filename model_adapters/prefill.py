"""One prompt's prefill alone (batch 1, no padding), as a decoding slot takes it, without the host waiting
on the device between layers.

On a GPU the host launches a prefill's few thousand kernels one after another. A host sync among them (the
Triton MoE reading, once a layer, how many rows its fast path left) makes the host wait until the device has
run everything queued, and the device then wait for the host's next launches: the prefill takes the host's
time plus the device's instead of the longer of the two. Here that read is deferred to the end of the
forward (``moe.defer_finish``, as a graphed decoding step defers it): one read after the last layer says
whether any layer's fast path left rows, and if one did the prompt is prefilled again without deferral,
every layer finishing its rows, so the result is always the undeferred forward's.
"""

from __future__ import annotations

import torch

from evalgate.kernels.triton import moe

STATS = {"deferred": 0, "again": 0}  # prefills run with the sync deferred, and those run again


def defers(model, device) -> bool:
    """Whether ``prefill_alone`` defers the MoE's host sync: on a GPU, with PyTorch's numerics (the canonical
    forward synchronises with the host anyway), experts on the Triton path that can defer."""
    from evalgate.model_adapters.invariant import numerics
    from evalgate.model_adapters.step_graphs import why_not_deferred

    device = torch.device(device)
    return device.type == "cuda" and numerics(model) == "native" and why_not_deferred(model, device) is None


def prefill_alone(model, ids: list[int], device, defer: bool | None = None):
    """transformers' forward of one prompt with a fresh cache, the last position's logits only: the model's
    output (``logits`` [1, 1, V], ``past_key_values``). ``defer``: None decides by ``defers``."""
    input_ids = torch.tensor([ids], device=device)
    if defers(model, device) if defer is None else defer:
        STATS["deferred"] += 1
        with moe.defer_finish() as layers:
            out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
            slow = layers.slow_rows(input_ids.device)
        if not int(slow):
            return out
        STATS["again"] += 1
        del out
    return model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
