"""Write a DeepSeek-V4 checkpoint with random weights in DeepSeek-V4's FP4 format, one layer per shard.

What ``kernels.checkpoint.save_fp4_checkpoint`` writes for a model in memory, written here for a model that
is never in memory: each decoder layer is built on the meta device (shapes only), its dense tensors are
drawn at once in BF16 under the DeepSeek-V4 checkpoint names (transformers' reverse conversion mapping), its
routed experts as random packed E2M1 codes (int8, two per byte) with UE8M0 scale bytes (``float8_e8m0fnu``,
one per 32 along K), and the shard is written and freed before the next layer is drawn. Peak memory is one
layer's tensors. For throughput and memory measurements only: the weights are noise.
"""

from __future__ import annotations

import copy
import json
import re
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


def _expert_tensors(layer: int, experts: int, hidden: int, inter: int, rng: np.random.Generator,
                    prefix: str | None = None) -> dict:
    out = {}
    prefix = prefix or f"model.layers.{layer}"
    for e in range(experts):
        for w, (rows, k) in (("1", (inter, hidden)), ("3", (inter, hidden)), ("2", (hidden, inter))):
            key = f"{prefix}.ffn.experts.{e}.w{w}"
            if rng is None:  # shapes only (``released_specs``)
                out[f"{key}.weight"] = torch.empty(rows, k // 2, dtype=torch.int8, device="meta")
                out[f"{key}.scale"] = torch.empty(rows, k // 32, dtype=torch.float8_e8m0fnu, device="meta")
                continue
            codes = np.frombuffer(rng.bytes(rows * k // 2), dtype=np.int8).reshape(rows, k // 2)
            scale = np.full((rows, k // 32), SCALE_BYTE, dtype=np.uint8)
            scale += rng.integers(0, 2, size=scale.shape, dtype=np.uint8)  # 2^-8 or 2^-7 per group
            out[f"{key}.weight"] = torch.from_numpy(codes.copy())
            out[f"{key}.scale"] = torch.from_numpy(scale).view(torch.float8_e8m0fnu)
    return out


def _write_shards(out: Path, shards, log) -> None:
    """Save each ``(file name, tensors)`` of ``shards`` as it is made (one shard in memory at a time; the
    time logged includes making it), then the index that names every tensor's shard."""
    import time

    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    shards = iter(shards)
    while True:
        t0 = time.perf_counter()
        try:
            shard, tensors = next(shards)
        except StopIteration:
            break
        save_file(tensors, out / shard, metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total += size
        weight_map.update(dict.fromkeys(tensors, shard))
        del tensors
        log(f"wrote {shard}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def write_random_fp4_checkpoint(out: str | Path, config, tokenizer=None, seed: int = 0, log=print) -> Path:
    """Write ``config`` (a ``DeepseekV4Config``) with random weights to ``out``: one shard per decoder
    layer, then one for the embedding, final norm, hyper-connection head and output head; the index,
    config.json (``expert_dtype: fp4`` and the FP8 quantization_config, as ``save_fp4_checkpoint`` writes)
    and, when given, the tokenizer."""
    from evalgate.kernels.checkpoint import QUANTIZATION_CONFIG

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = _meta_model(config)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    layers = config.num_hidden_layers
    n_shards = layers + 1

    def shards():
        for i in range(n_shards):
            shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
            if i < layers:
                tensors = _dense_tensors(model, i, gen, std, config.n_routed_experts)
                tensors.update(_expert_tensors(i, config.n_routed_experts, config.hidden_size,
                                               config.moe_intermediate_size, rng))
            else:
                tensors = _dense_tensors(model, None, gen, std, config.n_routed_experts)
            yield shard, tensors

    _write_shards(out, shards(), log)
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


# --- the layout DeepSeek-V4-Flash is released in -------------------------------------------------------

RELEASED_F32 = re.compile(r"(?:attn_sink|\.ape|(?:^|\.)hc_(?:attn|ffn|head)_(?:base|fn|scale)|gate\.bias)$")


def released_config(config, mtp_layers: int = 1) -> dict:
    """config.json as DeepSeek-V4-Flash ships it for ``config`` (a ``DeepseekV4Config``): the reference's
    keys (``compress_ratios`` with the MTP layer's entry after the decoder layers', ``num_hash_layers``,
    ``qk_rope_head_dim``, ``rope_scaling``), ``expert_dtype: fp4`` and an FP8 ``quantization_config`` with no
    ``modules_to_not_convert``: the dense linears ARE FP8."""
    from evalgate.kernels.checkpoint import QUANTIZATION_CONFIG

    cfg = config.to_dict()
    ratios = {"sliding_attention": 0, **cfg["compress_rates"]}
    compress = cfg["rope_parameters"]["compress"]
    for derived in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor", "compress_rates",
                    "dtype", "transformers_version", "_name_or_path", "id2label", "label2id"):
        cfg.pop(derived, None)
    cfg.update(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", torch_dtype="bfloat16",
        compress_ratios=[ratios[t] for t in config.layer_types] + [0] * mtp_layers,
        num_hash_layers=sum(t == "hash_moe" for t in config.mlp_layer_types),
        qk_rope_head_dim=int(config.head_dim * config.partial_rotary_factor),
        rope_theta=config.rope_parameters["main"]["rope_theta"], compress_rope_theta=compress["rope_theta"],
        num_nextn_predict_layers=mtp_layers, expert_dtype="fp4",
        quantization_config=dict(QUANTIZATION_CONFIG))
    if compress.get("rope_type") == "yarn":
        cfg["rope_scaling"] = {"type": "yarn", **{k: compress[k] for k in (
            "factor", "beta_fast", "beta_slow", "original_max_position_embeddings") if k in compress}}
    return cfg


def _released_dense(model, layer: int | None, seed: int, std: float, num_experts: int, meta: bool,
                    rename_layer: str | None = None) -> dict[str, torch.Tensor]:
    """Released name -> tensor for the non-expert tensors of decoder layer ``layer`` (None: those outside the
    layers): FP8 E4M3 + UE8M0 128 x 128 scales for the dense linears, float32 sinks, position biases,
    hyper-connection weights and router bias, int64 hash tables, BF16 the rest. ``rename_layer``: the prefix
    that replaces ``layers.N`` (the MTP layer). ``meta``: shapes and dtypes only."""
    from evalgate.kernels.fp8_blocks import quantize, scale_grid
    from evalgate.model_adapters.loading.released_layout import FP8_LINEAR, released_key

    gen = torch.Generator().manual_seed(seed)
    if meta:
        tensors = _dense_shapes(model, layer)
    else:
        tensors = _dense_tensors(model, layer, gen, std, num_experts)
    out = {}
    for reverted, value in tensors.items():
        key = released_key(reverted)
        if rename_layer is not None:
            key = key.replace(f"layers.{layer}.", f"{rename_layer}.", 1)
        if FP8_LINEAR.search(key):
            if meta:
                out[key] = torch.empty(value.shape, dtype=torch.float8_e4m3fn, device="meta")
                out[key[: -len("weight")] + "scale"] = torch.empty(scale_grid(value.shape), dtype=torch.float8_e8m0fnu,
                                                                   device="meta")
            else:
                out[key], out[key[: -len("weight")] + "scale"] = quantize(value)
        elif RELEASED_F32.search(key):
            out[key] = value.to(torch.float32)
        else:
            out[key] = value if not value.is_floating_point() else value.to(torch.bfloat16)
    return out


def _dense_shapes(model, layer: int | None) -> dict[str, torch.Tensor]:
    """``_dense_tensors``' names with meta tensors of the model's shapes (BF16 for floats)."""
    from transformers.core_model_loading import revert_weight_conversion

    prefix = f"model.layers.{layer}."
    sd = {k: v for k, v in model.state_dict().items() if ".experts." not in k
          and (k.startswith(prefix) if layer is not None else not k.startswith("model.layers."))}
    sd = {k: torch.empty(v.shape, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype, device="meta")
          for k, v in sd.items()}
    return revert_weight_conversion(model, sd)


def _mtp_projections(hidden: int, seed: int, std: float, meta: bool) -> dict[str, torch.Tensor]:
    """The MTP layer's own tensors beside its decoder layer (DeepSeek's reference names): the embedding and
    hidden-state projections (FP8), their norms and the layer's output norm (BF16), and its
    hyper-connection head (float32)."""
    from evalgate.kernels.fp8_blocks import quantize, scale_grid

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("e_proj", "h_proj"):
        if meta:
            out[f"mtp.0.{name}.weight"] = torch.empty(hidden, hidden, dtype=torch.float8_e4m3fn, device="meta")
            out[f"mtp.0.{name}.scale"] = torch.empty(scale_grid((hidden, hidden)), dtype=torch.float8_e8m0fnu,
                                                     device="meta")
        else:
            out[f"mtp.0.{name}.weight"], out[f"mtp.0.{name}.scale"] = quantize(torch.randn(hidden, hidden, generator=gen) * std)
    for name in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{name}.weight"] = (torch.empty(hidden, dtype=torch.bfloat16, device="meta") if meta
                                       else torch.ones(hidden, dtype=torch.bfloat16))
    return out


def _released_shards(model, config, mtp: bool, seed: int, meta: bool):
    """(shard file name, tensors) in writing order, interleaved as the release interleaves them: shard j holds
    layer j's routed experts beside layer j-1's dense tensors; the first also the embedding and the MTP
    layer's dense tensors, the last the final norm, hyper-connection head, output head and the MTP layer's
    experts. Every FP8 weight sits with its scale."""
    layers, e = config.num_hidden_layers, config.n_routed_experts
    h, inter = config.hidden_size, config.moe_intermediate_size
    std = float(getattr(config, "initializer_range", 0.02))
    n = layers + 1

    def experts(layer, prefix):
        rng = None if meta else np.random.default_rng([seed, 1, layer])
        return _expert_tensors(layer, e, h, inter, rng, prefix=prefix)

    def dense(layer):
        return _released_dense(model, layer, seed * 1000 + 2 * layer + 1, std, e, meta)

    outside = _released_dense(model, None, seed * 1000, std, e, meta)
    for j in range(n):
        tensors = {}
        if j == 0:
            tensors["embed.weight"] = outside.pop("embed.weight")
            if mtp:
                tensors.update(_released_dense(model, layers, seed * 1000 + 2 * layers + 1, std, e, meta,
                                               rename_layer="mtp.0"))
                tensors.update(_mtp_projections(h, seed * 1000 + 2 * layers + 2, std, meta))
        if j >= 1:
            tensors.update(dense(j - 1))
        if j < layers:
            tensors.update(experts(j, f"layers.{j}"))
        else:
            tensors.update(outside)
            if mtp:
                tensors.update(experts(layers, "mtp.0"))
        yield f"model-{j + 1:05d}-of-{n:05d}.safetensors", tensors


def _model_with_mtp(config, mtp: bool):
    """A meta model of the decoder layers, plus one more layer in the MTP layer's place (a sliding-window
    MoE layer: its entry in ``compress_ratios`` is 0) whose tensors are written under ``mtp.0``."""
    if not mtp:
        return _meta_model(config)
    extended = copy.deepcopy(config)
    extended.num_hidden_layers = config.num_hidden_layers + 1
    extended.layer_types = list(config.layer_types) + ["sliding_attention"]
    extended.mlp_layer_types = list(config.mlp_layer_types) + ["moe"]
    return _meta_model(extended)


def released_specs(config, mtp: bool = True) -> list:
    """The ``checkpoint_bytes.StoredTensor`` of every tensor ``write_released_checkpoint`` would write, from
    shapes alone (nothing drawn, nothing written): the whole model's bytes without writing it."""
    from evalgate.model_adapters.loading.checkpoint_bytes import StoredTensor

    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.int8: "I8",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0"}
    model = _model_with_mtp(config, mtp)
    out = []
    for shard, tensors in _released_shards(model, config, mtp, 0, meta=True):
        for key, t in sorted(tensors.items()):
            out.append(StoredTensor(key, shard, names[t.dtype], tuple(t.shape), t.numel() * t.element_size()))
    return out


def write_released_checkpoint(out: str | Path, config, tokenizer=None, seed: int = 0, mtp: bool = True,
                              log=print) -> Path:
    """Write ``config`` (a ``DeepseekV4Config``) with random weights to ``out`` in the layout DeepSeek-V4-Flash
    is released in (``released_layout``): reference names without ``model.``, dense linears FP8 E4M3 with
    UE8M0 128 x 128 block scales, packed FP4 experts, float32 sinks / position biases / hyper-connections,
    int64 hash tables, the MTP layer (``mtp.0.*``, when ``mtp``), interleaved shards (``_released_shards``),
    the index, the released config.json (``released_config``) and, when given, the tokenizer. Peak memory is
    one shard's tensors."""
    from evalgate.kernels.fp8_blocks import BLOCK

    for name in ("hidden_size", "q_lora_rank", "o_lora_rank", "moe_intermediate_size", "index_head_dim"):
        v = getattr(config, name)
        if v > BLOCK and v % BLOCK:
            raise ValueError(f"{name} {v}: an FP8 linear's dimensions must be multiples of {BLOCK} or below it "
                             "(transformers derives the block size from the scale grid)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = _model_with_mtp(config, mtp)
    _write_shards(out, _released_shards(model, config, mtp, seed, meta=False), log)
    (out / "config.json").write_text(json.dumps(released_config(config, int(mtp)), indent=2, sort_keys=True,
                                                default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
