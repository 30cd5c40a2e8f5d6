"""DeepSeek-V4-Flash's checkpoint as released: its tensor names, which dense linears are FP8, and the check
that refuses a checkpoint laid out otherwise (docs/kernels.md#the-released-checkpoint).

The released files name tensors as DeepSeek's reference model does, without transformers' ``model.`` prefix
(``layers.3.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``); transformers' conversion mapping renames
them on load. The attention, compressor, indexer and shared-expert linears are FP8 E4M3 with a UE8M0
``.scale`` per 128 x 128 block beside each weight, in the same shard; the routed experts are packed FP4
(``kernels/checkpoint.py``); ``mtp.0.*`` is the multi-token-prediction layer, which transformers does not
build and evalgate never reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from evalgate.errors import UserError
from evalgate.kernels.fp8_blocks import scale_grid

# the dense linears DeepSeek-V4-Flash stores in FP8 (checkpoint names; the MTP layer's own projections too)
FP8_LINEAR = re.compile(r"(?:^|\.)(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|attn\.compressor\.(?:wkv|wgate)"
                        r"|attn\.indexer\.(?:wq_b|weights_proj)|attn\.indexer\.compressor\.(?:wkv|wgate)"
                        r"|shared_experts\.w[123]|e_proj|h_proj)\.weight$")
EXPERT = re.compile(r"(?:^|\.)ffn\.experts\.\d+\.w[123]\.(?:weight|scale)$")
# reference names of the tensors outside the decoder layers, where transformers' reverse mapping keeps its own
OUTSIDE = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale", "lm_head.weight": "head.weight"}


def released_key(reverted: str) -> str:
    """The released checkpoint's name for a key of transformers' reverse conversion mapping."""
    if reverted in OUTSIDE:
        return OUTSIDE[reverted]
    return reverted.removeprefix("model.")


def declares_fp8_dense(config: dict) -> bool:
    """Whether config.json says the dense linears are FP8: an FP8 block quantization_config that lists no
    ``modules_to_not_convert`` (evalgate's own FP4 checkpoints list every dense linear there, in BF16)."""
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "fp8" and bool(qc.get("weight_block_size")) and not qc.get("modules_to_not_convert")


def check_layout(path: str | Path, tensors=None) -> None:
    """Refuse, in one line naming the tensor, a checkpoint whose FP8 dense linears are not laid out as
    released: a weight without its ``.scale`` (or a scale in another shard), a BF16 weight where config.json
    declares FP8, a scale that is not UE8M0 or whose grid is not one per 128 x 128 block."""
    from evalgate.model_adapters.loading.checkpoint_bytes import stored_tensors

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8":
        return
    block = qc.get("weight_block_size")
    if block and list(block) != [128, 128]:
        raise UserError(f"{str(path)!r}: config.json's weight_block_size {block}; DeepSeek-V4 dense FP8 linears "
                        "use [128, 128]")
    declared = declares_fp8_dense(config)
    tensors = stored_tensors(path) if tensors is None else tensors
    by_key = {t.key: t for t in tensors}
    for t in tensors:
        if EXPERT.search(t.key) or not t.key.endswith(".weight"):
            continue
        base = t.key[: -len(".weight")]
        scale = by_key.get(base + ".scale")
        if t.dtype == "F8_E4M3":
            if scale is None:
                raise UserError(f"{str(path)!r}: {t.key} is FP8 but has no {base}.scale; the checkpoint is "
                                "incomplete or mis-laid")
            if scale.shard != t.shard:
                raise UserError(f"{str(path)!r}: {base}.scale is in {scale.shard}, its weight in {t.shard}; the "
                                "released layout keeps each FP8 weight and its scale in one shard")
            if scale.dtype != "F8_E8M0":
                raise UserError(f"{str(path)!r}: {base}.scale is {scale.dtype}, expected F8_E8M0 (UE8M0 block "
                                "scales, scale_fmt ue8m0)")
            if len(t.shape) != 2 or tuple(scale.shape) != scale_grid(t.shape):
                want = scale_grid(t.shape) if len(t.shape) == 2 else "a 2-D weight"
                raise UserError(f"{str(path)!r}: {base}.scale has shape {list(scale.shape)} for a weight of "
                                f"{list(t.shape)}; expected {list(want)} (one scale per 128 x 128 block)")
        elif declared and FP8_LINEAR.search(t.key):
            raise UserError(f"{str(path)!r}: {t.key} is {t.dtype} but config.json declares FP8 dense linears "
                            "(quantization_config without modules_to_not_convert); the checkpoint is mis-laid")
