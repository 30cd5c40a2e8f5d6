"""Write a DeepSeek-V4 checkpoint with random weights in DeepSeek-V4's FP4 format, one layer per shard.

What ``kernels.checkpoint.save_fp4_checkpoint`` writes for a model in memory, written here for a model that
is never in memory: each decoder layer is built on the meta device (shapes only), its dense tensors are
drawn at once in BF16 under the DeepSeek-V4 checkpoint names (transformers' reverse conversion mapping), its
routed experts as random packed E2M1 codes (int8, two per byte) with UE8M0 scale bytes (``float8_e8m0fnu``,
one per 32 along K), and the shard is written and freed before the next layer is drawn. Peak memory is one
layer's tensors. For throughput and memory measurements only: the weights are noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SCALE_BYTE = 119  # UE8M0 2^-8: E2M1 codes (|x| <= 6) give weights of |w| <= 0.023, std ~0.0125


def _meta_model(config):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=True):
        return AutoModelForCausalLM.from_config(config)


def _dense_value(name: str, shape, dtype, gen: torch.Generator, std: float, num_experts: int) -> torch.Tensor:
    """A plausible random value for one non-expert tensor (what ``_init_weights`` would draw)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # distinct experts per token, as a real hash layer has
        k = shape[1]
        return torch.argsort(torch.rand(shape[0], num_experts, generator=gen), dim=-1)[:, :k].contiguous()
    if name.endswith("norm.weight") or leaf in ("scale", "hc_scale"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if leaf in ("base", "hc_base", "sinks", "position_bias", "e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def _dense_tensors(model, layer: int | None, gen, std: float, num_experts: int) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor, for the non-expert tensors of decoder layer ``layer`` (None: those outside
    the decoder layers)."""
    from transformers.core_model_loading import revert_weight_conversion

    def wanted(k: str) -> bool:
        if ".experts." in k:
            return False
        return k.startswith(f"model.layers.{layer}.") if layer is not None else not k.startswith("model.layers.")

    sd = {k: v for k, v in model.state_dict().items() if wanted(k)}
    values = {k: _dense_value(k, tuple(v.shape), v.dtype, gen, std, num_experts) for k, v in sd.items()}
    by_id = {id(v): k for k, v in sd.items()}
    renamed = revert_weight_conversion(model, dict(sd))
    return {ckpt: values[by_id[id(v)]] for ckpt, v in renamed.items()}


def _expert_tensors(layer: int, experts: int, hidden: int, inter: int, rng: np.random.Generator) -> dict:
    out = {}
    for e in range(experts):
        for w, (rows, k) in (("1", (inter, hidden)), ("3", (inter, hidden)), ("2", (hidden, inter))):
            key = f"model.layers.{layer}.ffn.experts.{e}.w{w}"
            codes = np.frombuffer(rng.bytes(rows * k // 2), dtype=np.int8).reshape(rows, k // 2)
            scale = np.full((rows, k // 32), SCALE_BYTE, dtype=np.uint8)
            scale += rng.integers(0, 2, size=scale.shape, dtype=np.uint8)  # 2^-8 or 2^-7 per group
            out[f"{key}.weight"] = torch.from_numpy(codes.copy())
            out[f"{key}.scale"] = torch.from_numpy(scale).view(torch.float8_e8m0fnu)
    return out


def write_random_fp4_checkpoint(out: str | Path, config, tokenizer=None, seed: int = 0, log=print) -> Path:
    """Write ``config`` (a ``DeepseekV4Config``) with random weights to ``out``: one shard per decoder
    layer, then one for the embedding, final norm, hyper-connection head and output head; the index,
    config.json (``expert_dtype: fp4`` and the FP8 quantization_config, as ``save_fp4_checkpoint`` writes)
    and, when given, the tokenizer."""
    import time

    from safetensors.torch import save_file

    from evalgate.kernels.checkpoint import QUANTIZATION_CONFIG

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = _meta_model(config)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    layers = config.num_hidden_layers
    n_shards = layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(n_shards):
        t0 = time.perf_counter()
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        if i < layers:
            tensors = _dense_tensors(model, i, gen, std, config.n_routed_experts)
            tensors.update(_expert_tensors(i, config.n_routed_experts, config.hidden_size,
                                           config.moe_intermediate_size, rng))
        else:
            tensors = _dense_tensors(model, None, gen, std, config.n_routed_experts)
        save_file(tensors, out / shard, metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total += size
        weight_map.update(dict.fromkeys(tensors, shard))
        del tensors
        log(f"wrote {shard}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    cfg = config.to_dict()
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    cfg["dtype"] = "bfloat16"
    cfg["expert_dtype"] = "fp4"
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".experts" not in n]
    cfg["quantization_config"] = dict(QUANTIZATION_CONFIG, modules_to_not_convert=linears)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
