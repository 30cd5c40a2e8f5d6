"""KV caches of rows prefilled apart, stacked into one batch: DeepSeek-V4's sliding-window, CSA and HCA
layers, their compressors' and indexers' state included.

A decoding batch whose prompts are all prefilled in one call holds every prompt's activations at once: at
batch 256 with 8-shot GSM8K prompts (~900 tokens), DeepSeek-V4-Flash's hyper-connection streams alone are
tens of GiB. ``generation`` prefills such a batch a few rows at a time instead, every call left-padded to the
same width, and ``stack_rows`` joins their caches. With one width the calls' caches have one timeline: the
same number of keys per layer, the same compressor windows closed (transformers' compressors cut windows
along the padded timeline, the same for every row of a call), the same tokens left in each compressor's
buffer. So each piece of state is the rows of the calls, one after the other, and the stacked cache is the
one a single call over all the rows would have built.
"""

from __future__ import annotations

import torch

# per cache layer: the dict-of-tensors states of transformers' DeepseekV4HCACache / DeepseekV4CSACache
_STATE_DICTS = ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate")


def _layer_kinds():
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache

    return (DynamicLayer, DynamicSlidingWindowLayer, DeepseekV4HCACache, DeepseekV4CSACache)


def stackable(past) -> bool:
    """Whether every layer of ``past`` is one ``stack_rows`` knows (plain, sliding-window, CSA, HCA)."""
    layers = getattr(past, "layers", None)
    kinds = _layer_kinds()
    return bool(layers) and all(type(layer) in kinds and not getattr(layer, "record_past", False)
                                and "_evalgate_kv" not in layer.__dict__ for layer in layers)


def model_stackable(model) -> bool:
    """Whether the cache ``model`` builds (transformers' DynamicCache of its config) is ``stackable``."""
    from transformers.cache_utils import DynamicCache

    try:
        return stackable(DynamicCache(config=model.config))
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read: not stackable
        return False


def _cat(parts: list, what: str):
    """Tensors (or all None) along the batch; their other dimensions must agree."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts) or len({tuple(p.shape[1:]) for p in parts}) != 1:
        raise ValueError(f"cannot stack caches of different timelines ({what})")
    return torch.cat(parts, dim=0)


def stack_rows(pasts: list):
    """One cache holding the rows of ``pasts`` (caches of calls of one width, in order), built in the first
    of them. Raises ValueError when their timelines differ (different widths or steps)."""
    if not all(stackable(p) for p in pasts):
        raise ValueError("a cache layer that cannot be stacked along the batch")
    first = pasts[0]
    if len(pasts) == 1:
        return first
    for i, layer in enumerate(first.layers):
        others = [p.layers[i] for p in pasts]
        if len({type(x) for x in others}) != 1:
            raise ValueError(f"layer {i}: caches of different layer kinds")
        for attr in ("cumulative_length", "entry_count"):
            values = [getattr(x, attr, None) for x in others]
            if any(v != values[0] for v in values):
                raise ValueError(f"cannot stack caches of different timelines (layer {i} {attr}: {values})")
        if not all(x.is_initialized for x in others):
            raise ValueError(f"layer {i}: a cache layer that was never written")
        layer.keys = _cat([x.keys for x in others], f"layer {i} keys")
        shared = all(x.values is x.keys for x in others)  # V4's HCA / CSA layers keep K = V as one tensor
        layer.values = layer.keys if shared else _cat([x.values for x in others], f"layer {i} values")
        for name in _STATE_DICTS:
            states = getattr(layer, name, None)
            if states is None:
                continue
            for key in states:
                states[key] = _cat([getattr(x, name)[key] for x in others], f"layer {i} {name}[{key}]")
    return first
