"""Load a DeepSeek-V4 FP4 checkpoint tensor by tensor onto one or more devices, keeping the packed codes.

transformers' loader dequantizes FP4 experts to BF16 on a CPU (and ``hf.load_model`` always loads there):
at DeepSeek-V4-Flash width that is 12 GB of BF16 per layer. This loader never makes such a copy:

1. **Plan first** (``plan_load``): the bytes every part needs, from config.json and the safetensors headers
   (``checkpoint_bytes``), are placed over the devices (``placement.plan``) before anything is read; a model
   that does not fit ends in one line naming the bytes needed and available (exit 2).
2. **Skeleton**: the model is built with its parameters on the meta device (no memory). Each routed-experts
   module gets packed parameters instead of its BF16 ones: ``gate_up_proj`` int8 [E, 2I, H/2] (two E2M1
   codes per byte, low nibble = even K) with ``gate_up_proj_scale_inv`` UE8M0 bytes [E, 2I, H/32], and
   ``down_proj`` [E, H, I/2] with ``down_proj_scale_inv`` [E, H, I/32] — the layout transformers' FP8Experts
   hold on a GPU, which ``kernels.weights.fp4_weights`` reads as stored. They are allocated on their
   layer's device.
3. **Stream**: shard by shard, tensor by tensor (safetensors memory-maps the file), each tensor is copied to
   its device: expert codes and scales byte for byte into their expert's slice, other tensors under their
   transformers name (``conversion_mapping`` renamings) at the dtype ``hf.load_model`` gives them
   (``dense_dtype``), so the model is the same one, bit for bit, apart from the experts' storage.
   FP8 dense linears (DeepSeek-V4-Flash as released: E4M3 with UE8M0 128 x 128 block scales) stay FP8 on a
   GPU (``fp8_linear.keep_fp8``: their ``weight`` reads as the exact dequantization) and are dequantized once,
   exactly, on a CPU, as transformers does. The MTP layer (``mtp.N.…``) is never read.
4. **Dispatch** (``dispatch``, after any forward-pass patching): over several devices, accelerate's hooks move
   activations between the layers' devices; on CUDA each layer makes its device current (Triton launches
   on the current device).

Only the emulated FP4 kernels can run such a model (the ``bf16`` reference needs BF16 experts).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from evalgate.errors import UserError

from .checkpoint_bytes import DTYPE_BYTES, StoredTensor, fp8_dense_keys, stored_tensors, unit_bytes, unit_of
from .released_layout import check_layout
from .placement import PREFIX, SUFFIX, Placement, Reserve, kv_bytes_per_token_layer, plan, parse_device_map

EXPERT = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.ffn\.experts\.(?P<e>\d+)\.w(?P<w>[123])\.(?P<kind>weight|scale)$")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# the activation/KV reserve a plan keeps per device unless told otherwise (EVALGATE_RESERVE_GIB overrides)
DEFAULT_TOKENS = 32 * 2048  # batch 32 x 2048 tokens: the KV cache of a GSM8K batch with its 8-shot prompt


@dataclass(frozen=True)
class LoadPlan:
    config: dict
    tensors: list[StoredTensor]
    sizes: dict[str, int]
    placement: Placement
    load_dtype: str
    keep_fp8: bool = False  # FP8 dense weights stay FP8 (every device a GPU)


def default_reserve(config: dict, load_dtype: str, tokens: int = DEFAULT_TOKENS) -> Reserve:
    workspace = int(float(os.environ.get("EVALGATE_RESERVE_GIB", "4")) * (1 << 30))
    return Reserve(workspace, kv_bytes_per_token_layer(config, DTYPE_BYTES[load_dtype]), tokens)


def device_capacities(devices: list[str]) -> list[tuple[str, int]]:
    """[(device, bytes free now)]: CUDA's free memory, or the CPU's MemAvailable."""
    out = []
    for d in devices:
        if d.startswith("cuda"):
            if not torch.cuda.is_available():
                raise UserError(f"{d} was asked for (--device or --device-map) but no CUDA device is visible; use cpu")
            index = torch.device(d).index
            free, _ = torch.cuda.mem_get_info(0 if index is None else index)
            out.append((d if index is not None else "cuda:0", int(free)))
        else:
            out.append(("cpu", _mem_available()))
    return out


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def resolve_devices(device_map: str) -> list[str]:
    devices = parse_device_map(device_map)
    if devices == ["auto"]:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:  # said, not silent: a user asking for "every GPU" may not expect an hours-long CPU run
            print("evalgate: note: --device-map auto found no GPU; the model is placed on the CPU", file=sys.stderr)
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    return ["cuda:0" if d == "cuda" else d for d in devices]


def plan_load(path: str | Path, devices: list[tuple[str, int]], dtype: str | None = None,
              reserve: Reserve | None = None) -> LoadPlan:
    """Everything decided before loading: bytes per part and the placement (raises UserError if it does
    not fit). ``devices``: [(name, available bytes)]."""
    from evalgate.kernels.checkpoint import is_fp4_checkpoint

    path = Path(path)
    if not is_fp4_checkpoint(path):
        raise UserError(f"{str(path)!r} is not an FP4 checkpoint (config.json has no expert_dtype: fp4); "
                        "streamed loading with --device-map keeps packed FP4 experts, drop --device-map for this one")
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "deepseek_v4":
        raise UserError(f"streamed loading covers DeepSeek-V4 checkpoints, not model_type {config.get('model_type')!r}")
    load_dtype = dtype or config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if load_dtype not in TORCH_DTYPES:
        raise UserError(f"load dtype {load_dtype!r}; choose one of {', '.join(TORCH_DTYPES)}")
    tensors = stored_tensors(path)
    check_layout(path, tensors)
    keep_fp8 = all(name.startswith("cuda") for name, _ in devices)
    sizes = unit_bytes(tensors, load_dtype, keep_fp8)
    reserve = reserve or default_reserve(config, load_dtype)
    return LoadPlan(config, tensors, sizes, plan(sizes, devices, reserve), load_dtype, keep_fp8)


# --- the skeleton -----------------------------------------------------------------------------------


def _skeleton(path: Path, kernel_name: str, load_dtype: torch.dtype):
    """The model on the meta device: shapes and dtypes, no memory (``_fill_buffers`` computes the buffers the
    checkpoint does not hold, e.g. RoPE tables, once the tensors are in)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    config._experts_implementation = kernel_name
    config.dtype = load_dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(load_dtype)  # as transformers builds it: parameters' empty dtype is the load dtype
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, experts_implementation=kernel_name)
    finally:
        torch.set_default_dtype(previous)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def pack_experts(module, device) -> None:
    """Replace a routed-experts module's BF16 (meta) parameters with empty packed FP4 ones on ``device``."""
    e, two_i, h = module.gate_up_proj.shape
    i = module.down_proj.shape[2]
    for name, shape, dtype in (("gate_up_proj", (e, two_i, h // 2), torch.int8),
                               ("gate_up_proj_scale_inv", (e, two_i, h // 32), torch.uint8),
                               ("down_proj", (e, h, i // 2), torch.int8),
                               ("down_proj_scale_inv", (e, h, i // 32), torch.uint8)):
        module._parameters[name] = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                      requires_grad=False)


# --- the tensors ------------------------------------------------------------------------------------


class NameMap:
    """Checkpoint key -> (model key, whether transformers' FP4 load keeps it at its stored dtype)."""

    def __init__(self, model):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, build_glob_alternation

        mapping = get_model_conversion_mapping(model)
        self.renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        self.converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self.prefix = model.base_model_prefix
        self.meta = model.state_dict()
        plan = model._get_dtype_plan(model.config.dtype)
        self.fp32 = build_glob_alternation(list(plan))[0] if plan else None

    def __call__(self, key: str) -> tuple[str, bool]:
        from transformers.core_model_loading import rename_source_key

        renamed, _ = rename_source_key(key, self.renamings, self.converters, self.prefix, self.meta)
        if renamed in self.meta:
            # transformers' FP8 loader (dequantizing on a CPU) sends every ``….weight`` it renamed or kept
            # through its dequantize op, which leaves a BF16 tensor at its stored dtype
            return renamed, renamed.endswith(".weight")
        renamed, _ = rename_source_key(key, [], [], self.prefix, self.meta)  # transformers' fallback
        return renamed, False

    def dense_dtype(self, model_key: str, kept_as_stored: bool, stored: torch.dtype, load: torch.dtype) -> torch.dtype:
        """The dtype ``hf.load_model`` gives this tensor (transformers 5.23's FP4 load, dequantizing)."""
        if not stored.is_floating_point or kept_as_stored:
            return stored
        if self.fp32 is not None and self.fp32.search(model_key):
            return torch.float32
        empty = self.meta[model_key].dtype
        return empty if empty != load else load


def _set_tensor(model, key: str, value: torch.Tensor) -> None:
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    elif name in module._buffers:
        module._buffers[name] = value
    else:
        raise KeyError(key)


def _set_fp8(model, key: str, codes: torch.Tensor, scale: torch.Tensor, device, dtype: torch.dtype,
             keep: bool) -> None:
    """An FP8 dense weight: kept FP8 with its block scales (``fp8_linear.keep_fp8``), or dequantized exactly to
    ``dtype`` (transformers' CPU load)."""
    from evalgate.kernels.fp8_blocks import dequantize
    from evalgate.model_adapters.canonical.fp8_linear import keep_fp8

    module_name, _, name = key.rpartition(".")
    if name != "weight":
        raise UserError(f"FP8 tensor for {key!r}: only linear weights are stored in FP8")
    if keep:
        keep_fp8(model.get_submodule(module_name), codes.to(device), scale.to(device), dtype)
    else:
        _set_tensor(model, key, dequantize(codes, scale, dtype).to(device))


def _unit_modules(model) -> dict[str, list[str]]:
    """placement unit -> the model's modules it covers (accelerate's device map keys)."""
    layers = model.model.layers
    return {PREFIX: ["model.embed_tokens", "model.rotary_emb"],
            **{f"layer.{i}": [f"model.layers.{i}"] for i in range(len(layers))},
            SUFFIX: ["model.norm", "model.hc_head", "lm_head"]}


def stream_load(path: str | Path, kernel_name: str, load_plan: LoadPlan):
    """The model of ``load_plan``, its tensors streamed to their devices (module docstring, steps 2-3)."""
    from safetensors import safe_open

    path = Path(path)
    load = TORCH_DTYPES[load_plan.load_dtype]
    model = _skeleton(path, kernel_name, load)
    units = load_plan.placement.units
    from evalgate.kernels.checkpoint import experts_modules

    experts = experts_modules(model)
    for layer, module in experts.items():
        pack_experts(module, units[f"layer.{layer}"])
    names = NameMap(model)
    fp8 = fp8_dense_keys(load_plan.tensors)
    loaded: set[str] = set()
    filled: dict[int, int] = {}
    for shard in sorted({t.shard for t in load_plan.tensors}):
        with safe_open(path / shard, "pt", device="cpu") as f:
            for key in f.keys():
                unit = unit_of(key)
                if unit is None or (key in fp8 and key.endswith(".scale")):
                    continue  # the MTP layer is never read; a block scale is read with its weight
                device = units[unit]
                m = EXPERT.match(key)
                if m:
                    _copy_expert(experts, m, f.get_tensor(key), device)
                    filled[int(m["layer"])] = filled.get(int(m["layer"]), 0) + 1
                    continue
                model_key, as_stored = names(key)
                if model_key not in names.meta:
                    raise UserError(f"{str(path / shard)!r}: tensor {key!r} has no place in a {type(model).__name__} "
                                    "with this config.json; the checkpoint does not match its config")
                t = f.get_tensor(key)
                if key in fp8:
                    _set_fp8(model, model_key, t, f.get_tensor(key[: -len("weight")] + "scale"), device,
                             names.meta[model_key].dtype, load_plan.keep_fp8)
                else:
                    _set_tensor(model, model_key,
                                t.to(device=device, dtype=names.dense_dtype(model_key, as_stored, t.dtype, load)))
                loaded.add(model_key)
    for layer, module in experts.items():
        expected = 6 * module.gate_up_proj.shape[0]  # w1, w2, w3 and their scales per expert
        if filled.get(layer, 0) != expected:
            raise UserError(f"{str(path)!r}: layer {layer} has {filled.get(layer, 0)} of {expected} expert tensors; "
                            "the checkpoint is incomplete")
    missing = [k for k in names.meta if k not in loaded and ".experts." not in k
               and _is_meta(model, k)]
    if missing:
        raise UserError(f"{str(path)!r} lacks {len(missing)} tensors the model needs ({missing[0]}, ...); the checkpoint is incomplete")
    for unit, modules in _unit_modules(model).items():
        for name in modules:
            _fill_buffers(model, model.get_submodule(name), units.get(unit, load_plan.placement.devices[0]))
    model._evalgate_placement = load_plan.placement
    return model


def _fill_buffers(model, root, device) -> None:
    """Buffers the checkpoint does not hold (RoPE tables) computed on ``device`` as transformers computes
    them after its own meta-device build (``_init_weights``)."""
    for name, module in root.named_modules():
        if any(b.device.type == "meta" for b in module.buffers(recurse=False)):
            if any(p.device.type == "meta" for p in module.parameters(recurse=False)):
                raise UserError(f"{name}: parameters missing from the checkpoint")
            module.to_empty(device=device, recurse=False)
            model._init_weights(module)
            if any(b.device.type == "meta" for b in module.buffers(recurse=False)):
                raise UserError(f"{name}: a buffer neither in the checkpoint nor computable")


def _is_meta(model, key: str) -> bool:
    module_name, _, name = key.rpartition(".")
    t = getattr(model.get_submodule(module_name), name)
    return t.device.type == "meta"


def _copy_expert(experts, m, t: torch.Tensor, device) -> None:
    """One expert's w1 (gate), w3 (up) or w2 (down) codes or scale bytes, byte for byte into its slice."""
    module = experts[int(m["layer"])]
    e, w, kind = int(m["e"]), m["w"], m["kind"]
    name = ("gate_up_proj" if w in "13" else "down_proj") + ("_scale_inv" if kind == "scale" else "")
    param = module._parameters[name]
    half = param.shape[1] // 2
    target = param.data[e, :half] if w == "1" else param.data[e, half:] if w == "3" else param.data[e]
    source = t.view(param.dtype) if t.dtype != param.dtype else t
    if source.shape != target.shape:
        raise UserError(f"expert tensor layers.{m['layer']}.ffn.experts.{e}.w{w}.{kind} has shape "
                        f"{tuple(source.shape)}, expected {tuple(target.shape)} from config.json")
    target.copy_(source.to(device), non_blocking=False)


# --- several devices --------------------------------------------------------------------------------


def dispatch(model):
    """Over several devices: accelerate's hooks move activations to each part's device, and on CUDA each
    decoder layer makes its device current before it runs. One device: nothing to do."""
    placement: Placement | None = getattr(model, "_evalgate_placement", None)
    if placement is None or len(placement.devices) < 2:
        return model
    from accelerate import dispatch_model

    device_map = {name: placement.units[unit] for unit, names in _unit_modules(model).items()
                  if unit in placement.units for name in names}
    model = dispatch_model(model, device_map=device_map, main_device=placement.devices[0])
    for i, layer in enumerate(model.model.layers):
        device = torch.device(placement.units[f"layer.{i}"])
        if device.type == "cuda":
            layer.register_forward_pre_hook(lambda module, args, d=device: torch.cuda.set_device(d))
    return model


def load_streamed(path: str | Path, kernel_name: str, device_map: str, dtype: str | None = None,
                  reserve: Reserve | None = None):
    """Plan, then stream: the model on the devices of ``device_map`` (``auto``, ``cpu``, ``cuda:0,cuda:1``)."""
    from evalgate.kernels import get_kernel

    kernel = get_kernel(kernel_name)
    if getattr(kernel.experts_forward, "recipe", None) is None:
        raise UserError(f"kernel {kernel_name!r} computes with BF16 experts; streamed loading keeps them packed "
                        "FP4: choose an emulated kernel (w4a8, w4a4_packed, ...) or drop --device-map")
    devices = device_capacities(resolve_devices(device_map))
    load_plan = plan_load(path, devices, dtype, reserve)
    return stream_load(path, kernel_name, load_plan)
