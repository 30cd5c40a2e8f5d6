"""The DeepSeek-V4 FP4 checkpoint (spec docs/kernels.md#fp4-checkpoint): writer, reader, and the link from stored codes to kernels.

Format written by `save_fp4_checkpoint`:
- routed experts ``…ffn.experts.{e}.w1/w3/w2.weight``: int8, two E2M1 codes per byte, low nibble = even K;
  ``….scale``: float8_e8m0fnu, one byte per 32 K per row (names as transformers' reverse conversion
  mapping writes them, i.e. the DSV4-Flash names under the ``model.`` prefix);
- everything else: as the model holds it (BF16). DSV4-Flash ships non-expert linears in FP8 128x128 (and
  evalgate loads it so: ``model_adapters/loading/released_layout.py``); this writer does not, because transformers
  derives the FP8 block size from the scale grid, which is only right when every dimension is a multiple
  of 128 or below it, and a small canary model's dims are not. They are listed in
  ``modules_to_not_convert`` so a GPU load (no dequantization) leaves them BF16 as well;
- config.json: ``expert_dtype: fp4`` and ``quantization_config`` fp8 / e4m3 / ue8m0 / dynamic / [128, 128].

Loading (`load_fp4_checkpoint`) goes through transformers: on CPU its FP8 quantizer forces
``dequantize=True``, unpacks the nibbles, applies the scales and leaves BF16 ``DeepseekV4Experts``
(lossless, docs/kernels.md#fp4-checkpoint step 4). The stored codes would then be gone, so the reader also reads them from the
safetensors files and attaches them to each experts module (`weights.attach_stored`): the emulated kernels
compute with the codes and scales exactly as stored, never re-rounded. On a GPU with compute capability
>= 8.9 transformers keeps ``FP8Experts`` with the int8 codes, which the kernels use directly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from evalgate.errors import UserError

from .weights import Fp4ExpertWeights, attach_stored, fp4_weights

EXPERT_KEY = re.compile(r"^(?P<prefix>(?:model\.)?layers\.(?P<layer>\d+)\.ffn\.experts\.(?P<e>\d+)\.w(?P<w>[123]))\.weight$")

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def experts_modules(model) -> dict[int, torch.nn.Module]:
    """layer index -> the routed experts module, for every MoE layer of a DeepseekV4 model."""
    out = {}
    for name, module in model.named_modules():
        m = re.search(r"layers\.(\d+)\.mlp\.experts$", name)
        if m and hasattr(module, "gate_up_proj"):
            out[int(m.group(1))] = module
    return out


def _non_expert_linears(model) -> list[str]:
    """Names of the linears to keep out of transformers' FP8 conversion, in the checkpoint's own naming
    where they have one (transformers maps the names back)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".experts" not in name:
            names.append(name)
    return names


def save_fp4_checkpoint(model, path, *, safe_serialization: bool = True) -> Path:
    """Write `model` (a ``DeepseekV4ForCausalLM``) as a DeepSeek-V4 FP4 checkpoint at `path`.

    Expert weights are encoded from `weights.fp4_weights`: codes a model was loaded with are written back
    unchanged; BF16 experts are quantized once (RCEIL, ties to even, no floor). Returns the path."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    experts = experts_modules(model)
    if not experts:
        raise UserError("save_fp4_checkpoint needs a DeepSeek-V4 MoE model (no `layers.N.mlp.experts` found)")
    model.save_pretrained(path, safe_serialization=safe_serialization)
    fp4 = {layer: fp4_weights(m) for layer, m in experts.items()}
    for shard in sorted(path.glob("*.safetensors")):
        tensors = load_file(shard)
        out = {}
        for key, value in tensors.items():
            m = EXPERT_KEY.match(key)
            if not m:
                out[key] = value
                continue
            codes, scale = _expert_tensor(fp4[int(m["layer"])], int(m["e"]), m["w"])
            out[f"{m['prefix']}.weight"] = codes.view(torch.int8).contiguous()
            out[f"{m['prefix']}.scale"] = scale.view(torch.float8_e8m0fnu).contiguous()
        save_file(out, shard, metadata={"format": "pt"})
    _rewrite_index(path)
    _write_config(path, _non_expert_linears(model))
    return path


def _expert_tensor(fp4: Fp4ExpertWeights, e: int, w: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scale bytes) of expert e's w1 (gate), w3 (up) or w2 (down)."""
    i = fp4.intermediate
    if w == "1":
        return fp4.w1[e, :i], fp4.w1_scale[e, :i]
    if w == "3":
        return fp4.w1[e, i:], fp4.w1_scale[e, i:]
    return fp4.w2[e], fp4.w2_scale[e]


def _rewrite_index(path: Path) -> None:
    """A sharded checkpoint's index lists every key; add the `.scale` siblings."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return
    data = json.loads(index.read_text())
    weight_map = data["weight_map"]
    for key, shard in list(weight_map.items()):
        m = EXPERT_KEY.match(key)
        if m:
            weight_map[f"{m['prefix']}.scale"] = shard
    index.write_text(json.dumps(data, indent=2, sort_keys=True))


def _write_config(path: Path, modules_to_not_convert: list[str]) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["expert_dtype"] = "fp4"
    cfg["quantization_config"] = dict(QUANTIZATION_CONFIG, modules_to_not_convert=modules_to_not_convert)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def is_fp4_checkpoint(path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return False
    data = json.loads(cfg.read_text())
    return data.get("expert_dtype") == "fp4" or (data.get("quantization_config") or {}).get("expert_dtype") == "fp4"


def read_stored_experts(path) -> dict[int, Fp4ExpertWeights]:
    """layer -> the routed experts' codes and scale bytes exactly as stored in the safetensors files."""
    from safetensors import safe_open

    found: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                m = EXPERT_KEY.match(key)
                if m:
                    entry = found.setdefault(int(m["layer"]), {}).setdefault(int(m["e"]), {})
                    entry["w" + m["w"]] = f.get_tensor(key)
                    entry["w" + m["w"] + "_scale"] = f.get_tensor(f"{m['prefix']}.scale")
    out = {}
    for layer, per_expert in found.items():
        ids = sorted(per_expert)
        if ids != list(range(len(ids))):
            raise UserError(f"FP4 checkpoint {path}: layer {layer} experts are not numbered 0..{len(ids) - 1}")
        stack = lambda name: torch.stack([per_expert[e][name].view(torch.uint8) for e in ids])  # noqa: E731
        out[layer] = Fp4ExpertWeights(
            w1=torch.cat([stack("w1"), stack("w3")], dim=1),
            w1_scale=torch.cat([stack("w1_scale"), stack("w3_scale")], dim=1),
            w2=stack("w2"),
            w2_scale=stack("w2_scale"),
            source="checkpoint",
        )
    return out


def attach_stored_fp4(model, path) -> int:
    """Attach the stored FP4 codes of checkpoint `path` to `model`'s experts modules (BF16 after a CPU
    load). Checks that the codes dequantize to exactly the weights transformers loaded. Returns the
    number of layers attached. FP8Experts modules (GPU load) already hold the codes and are skipped."""
    stored = read_stored_experts(path)
    attached = 0
    for layer, module in experts_modules(model).items():
        if module.gate_up_proj.dtype in (torch.int8, torch.uint8) or layer not in stored:
            continue
        fp4 = stored[layer].to(module.gate_up_proj.device)
        w1, w2 = fp4.dequantize()
        if not (torch.equal(w1.to(module.gate_up_proj.dtype), module.gate_up_proj.data)
                and torch.equal(w2.to(module.down_proj.dtype), module.down_proj.data)):
            raise UserError(f"FP4 checkpoint {path}: layer {layer} experts do not match the loaded weights; "
                            "re-export the checkpoint with evalgate's save_fp4_checkpoint")
        attach_stored(module, fp4)
        attached += 1
    return attached


def prepare_fp4_model(model, path) -> None:
    """`Kernel.prepare_model` of the emulated kernels, run after any transformers load of `path`: an FP4
    checkpoint's stored codes are attached; a BF16 checkpoint's experts are quantized now, once."""
    if is_fp4_checkpoint(path):
        attach_stored_fp4(model, path)
    for module in experts_modules(model).values():
        fp4_weights(module)


def dequantizing_config(path):
    """transformers' FP8 quantization config of an FP4 checkpoint, set to dequantize on load: experts come
    out as BF16 ``DeepseekV4Experts`` (exact, spec docs/kernels.md#fp4-checkpoint step 4) and no Hub kernel is fetched (step 5)."""
    from transformers import FineGrainedFP8Config

    cfg = json.loads((Path(path) / "config.json").read_text())
    qc = dict(cfg["quantization_config"])
    qc.pop("quant_method", None)
    qc.pop("fmt", None)
    qc["expert_dtype"] = "fp4"
    return FineGrainedFP8Config(**qc, dequantize=True)


def load_fp4_checkpoint(path, experts_implementation: str = "bf16", device: str = "cpu", **kwargs):
    """Load a DeepSeek-V4 FP4 checkpoint through transformers and attach its stored expert codes.

    Returns the ``DeepseekV4ForCausalLM``. On CPU (or a GPU below compute capability 8.9) transformers
    dequantizes the FP4 experts to BF16 on load; we force that on CPU so no Hub kernel is fetched
    (spec docs/kernels.md#fp4-checkpoint step 5)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise UserError(f"no config.json in {path}; pass the directory of a DeepSeek-V4 checkpoint")
    try:
        import accelerate  # noqa: F401  (transformers' FP8 quantizer requires it, even to dequantize)
    except ImportError as exc:
        raise UserError("loading an FP4/FP8 checkpoint needs accelerate: pip install accelerate") from exc
    if device == "cpu" and is_fp4_checkpoint(path):
        kwargs.setdefault("quantization_config", dequantizing_config(path))
    kwargs.setdefault("dtype", torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=experts_implementation, **kwargs)
    model = model.to(device).eval()
    if is_fp4_checkpoint(path):
        attach_stored_fp4(model, path)
    return model
