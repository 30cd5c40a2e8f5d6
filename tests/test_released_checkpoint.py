"""DeepSeek-V4-Flash's checkpoint as released (issue 50): the random checkpoint writer against the published
layout facts, loading it as released (FP8 dense linears dequantized exactly, MTP never read), the memory
estimate from its real bytes, and the one-line refusal of a mis-laid checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import evalgate.kernels.catalogs  # noqa: F401  (registers the kernels)
from evalgate.errors import UserError

pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

# The published layout of deepseek-ai/DeepSeek-V4-Flash (its safetensors headers and config.json, as read by
# public checkpoint probes): name -> (safetensors dtype, shape at full width).
RELEASED = {
    "embed.weight": ("BF16", (129280, 4096)),
    "head.weight": ("BF16", (129280, 4096)),
    "norm.weight": ("BF16", (4096,)),
    "layers.0.attn_norm.weight": ("BF16", (4096,)),
    "layers.0.attn.wq_a.weight": ("F8_E4M3", (1024, 4096)),
    "layers.0.attn.wq_a.scale": ("F8_E8M0", (8, 32)),
    "layers.0.attn.attn_sink": ("F32", (64,)),
    "layers.2.attn.compressor.ape": ("F32", (4, 1024)),  # CSA layer
    "layers.3.attn.compressor.ape": ("F32", (128, 512)),  # HCA layer
    "layers.0.ffn.gate.tid2eid": ("I64", (129280, 6)),
    "layers.1.ffn.gate.tid2eid": ("I64", (129280, 6)),
    "layers.2.ffn.gate.tid2eid": ("I64", (129280, 6)),
    "layers.0.ffn.experts.0.w1.weight": ("I8", (2048, 2048)),
    "layers.0.ffn.experts.0.w3.weight": ("I8", (2048, 2048)),
    "layers.0.ffn.experts.0.w2.weight": ("I8", (4096, 1024)),
    "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", (2048, 128)),
    "layers.0.ffn.experts.0.w2.scale": ("F8_E8M0", (4096, 64)),
}
FP8_PAIRS = ["attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "ffn.shared_experts.w1",
             "ffn.shared_experts.w2", "ffn.shared_experts.w3"]
F32_LEAVES = ["hc_attn_base", "hc_attn_fn", "hc_attn_scale", "hc_ffn_base", "hc_ffn_fn", "hc_ffn_scale"]
CONFIG = {"model_type": "deepseek_v4", "torch_dtype": "bfloat16", "hidden_size": 4096, "num_attention_heads": 64,
          "head_dim": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64, "o_lora_rank": 1024, "o_groups": 8,
          "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "n_shared_experts": 1,
          "num_hash_layers": 3, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
          "index_topk": 512, "compress_rope_theta": 160000, "hc_mult": 4, "hc_sinkhorn_iters": 20,
          "swiglu_limit": 10.0, "expert_dtype": "fp4"}


def _small(layers=4, experts=4):
    from dsv4_flash_fullwidth import flash_config

    return flash_config(layers=layers, experts=experts, scale=1 / 32, vocab=512)


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A small DeepSeek-V4-Flash in the released layout (sliding, CSA and HCA layers, hash and score routing,
    the MTP layer) with a BPE tokenizer."""
    from dsv4_flash_fullwidth import tokenizer_for

    from evalgate.model_adapters.random_fp4 import write_released_checkpoint

    out = tmp_path_factory.mktemp("released") / "model"
    return write_released_checkpoint(out, _small(), tokenizer_for(out), log=lambda s: None)


def test_full_width_header_has_the_released_names_dtypes_and_shapes():
    from dsv4_flash_fullwidth import flash_config

    from evalgate.model_adapters.random_fp4 import released_config, released_specs

    config = flash_config(layers=4)
    specs = {t.key: t for t in released_specs(config)}
    for key, (dtype, shape) in RELEASED.items():
        assert (specs[key].dtype, specs[key].shape) == (dtype, shape), key
    assert not any(k.startswith("model.") for k in specs)
    for layer in range(4):
        for pair in FP8_PAIRS:
            w, s = specs[f"layers.{layer}.{pair}.weight"], specs[f"layers.{layer}.{pair}.scale"]
            assert (w.dtype, s.dtype) == ("F8_E4M3", "F8_E8M0"), pair
            assert s.shape == tuple(-(-d // 128) for d in w.shape), pair
            assert s.shard == w.shard, pair  # every FP8 weight sits with its scale
        for leaf in F32_LEAVES:
            assert specs[f"layers.{layer}.{leaf}"].dtype == "F32"
    for key in ("layers.2.attn.compressor.wkv", "layers.2.attn.indexer.wq_b"):
        assert (specs[key + ".weight"].dtype, specs[key + ".scale"].dtype) == ("F8_E4M3", "F8_E8M0")
    assert "layers.3.attn.indexer.wq_b.weight" not in specs  # the indexer is the CSA layers' only
    assert "layers.3.ffn.gate.tid2eid" not in specs  # layers 3+ route by score
    assert {specs[k].dtype for k in ("hc_head_base", "hc_head_fn", "hc_head_scale")} == {"F32"}
    mtp = [k for k in specs if k.startswith("mtp.0.")]
    assert "mtp.0.attn.wq_a.weight" in mtp and "mtp.0.ffn.experts.255.w2.scale" in mtp
    shards = {t.shard for t in specs.values()}
    mixed = [s for s in shards if len({k.split(".")[1] for k, t in specs.items()
                                       if t.shard == s and k.startswith(("layers.", "mtp."))}) > 1]
    assert mixed, "the shards interleave the layers, as the release does"
    cfg = released_config(config)
    for key, value in CONFIG.items():
        assert cfg[key] == value, key
    assert cfg["compress_ratios"] == [0, 0, 4, 128, 0]  # the MTP layer's entry after the decoder layers'
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["scale_fmt"], qc["weight_block_size"]) == ("fp8", "e4m3", "ue8m0",
                                                                                          [128, 128])
    assert "modules_to_not_convert" not in qc
    assert cfg["rope_scaling"] == {"type": "yarn", "factor": 16.0, "beta_fast": 32, "beta_slow": 1,
                                   "original_max_position_embeddings": 65536}


def test_written_header_is_what_the_specs_say(released):
    from evalgate.model_adapters.checkpoint_bytes import stored_tensors
    from evalgate.model_adapters.random_fp4 import released_specs

    written = sorted((t.key, t.shard, t.dtype, t.shape, t.nbytes) for t in stored_tensors(released))
    planned = sorted((t.key, t.shard, t.dtype, t.shape, t.nbytes) for t in released_specs(_small()))
    assert written == planned
    index = json.loads((released / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t[4] for t in written)
    assert set(index["weight_map"]) == {t[0] for t in written}
