"""The DeepSeek-V4 FP4 checkpoint (spec docs/kernels.md#fp4-checkpoint): written by evalgate, loaded through transformers on CPU,
and computed with by the kernels exactly as stored."""

import json

import pytest
import torch

import evalgate.kernels as K
from evalgate.kernels import formats, weights
from evalgate.kernels.checkpoint import (
    attach_stored_fp4,
    is_fp4_checkpoint,
    load_fp4_checkpoint,
    read_stored_experts,
    save_fp4_checkpoint,
)
from evalgate.kernels.tiny_model import tiny_deepseek_v4

pytest.importorskip("accelerate")  # transformers' FP8 quantizer requires it, even to dequantize


def _non_canonical(fp4: weights.Fp4ExpertWeights) -> weights.Fp4ExpertWeights:
    """Re-encode expert 0, row 0, group 0 with its scale 4x larger (codes of magnitude <= 1.5): a valid
    encoding that quantizing the resulting BF16 weights would never produce (RCEIL picks the smallest
    scale that fits). If a loader re-rounded, these codes and scale would change."""
    codes = formats.unpack_e2m1(fp4.w1[0, 0])
    group = codes[:32]
    values = formats.dequantize(group[None], fp4.w1_scale[0, 0, :1][None], "e2m1")[0]
    byte = int(fp4.w1_scale[0, 0, 0]) + 2
    new = formats.e2m1_encode(values / 2.0 ** (byte - 127), "even")
    codes[:32] = new
    w1, s1 = fp4.w1.clone(), fp4.w1_scale.clone()
    w1[0, 0] = formats.pack_e2m1(codes)
    s1[0, 0, 0] = byte
    return weights.Fp4ExpertWeights(w1, s1, fp4.w2, fp4.w2_scale, source="test")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp4")
    model = tiny_deepseek_v4(seed=2)
    experts = model.model.layers[1].mlp.experts
    # snap the layer's BF16 weights to a non-canonical FP4 encoding, and let the writer use those codes
    fp4 = _non_canonical(weights.fp4_weights(experts))
    w1, w2 = fp4.dequantize()
    with torch.no_grad():
        experts.gate_up_proj.copy_(w1)
        experts.down_proj.copy_(w2)
    weights.attach_stored(experts, fp4)
    save_fp4_checkpoint(model, path)
    return path, model, fp4


def test_written_format(checkpoint):
    from safetensors import safe_open

    path, _, _ = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4"
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["scale_fmt"], qc["activation_scheme"], qc["weight_block_size"]) == (
        "fp8", "e4m3", "ue8m0", "dynamic", [128, 128])
    assert is_fp4_checkpoint(path)
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        w1 = f.get_tensor("model.layers.1.ffn.experts.0.w1.weight")
        s1 = f.get_tensor("model.layers.1.ffn.experts.0.w1.scale")
        w2 = f.get_tensor("model.layers.1.ffn.experts.3.w2.weight")
    assert w1.dtype == torch.int8 and w1.shape == (64, 64)  # [I, H/2]
    assert s1.dtype == torch.float8_e8m0fnu and s1.shape == (64, 4)  # [I, H/32]
    assert w2.shape == (128, 32)
    assert "model.layers.0.ffn.experts.7.w3.scale" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)


def test_loads_through_transformers_and_keeps_the_stored_codes(checkpoint):
    path, _, fp4 = checkpoint
    model = load_fp4_checkpoint(path, experts_implementation="w4a4_packed")
    experts = model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "DeepseekV4Experts"  # CPU: transformers dequantized on load
    w1, w2 = fp4.dequantize()
    assert torch.equal(experts.gate_up_proj.float(), w1) and torch.equal(experts.down_proj.float(), w2)
    used = weights.fp4_weights(experts)
    assert used.source == "checkpoint"
    assert torch.equal(used.w1, fp4.w1) and torch.equal(used.w1_scale, fp4.w1_scale)
    # re-quantizing the loaded BF16 weights would have given other codes for the same values
    requantized = weights.quantize_expert_weights(experts.gate_up_proj.data, experts.down_proj.data)
    assert not torch.equal(requantized.w1_scale, fp4.w1_scale)
    assert torch.equal(requantized.dequantize()[0], w1)


def test_stored_codes_are_read_as_written(checkpoint):
    path, model, fp4 = checkpoint
    stored = read_stored_experts(path)
    assert sorted(stored) == [0, 1]
    assert torch.equal(stored[1].w1, fp4.w1) and torch.equal(stored[1].w2_scale, fp4.w2_scale)
    original = weights.fp4_weights(model.model.layers[0].mlp.experts)
    assert torch.equal(stored[0].w1, original.w1)


def test_loaded_model_runs_every_kernel(checkpoint):
    path, _, _ = checkpoint
    model = load_fp4_checkpoint(path, experts_implementation="bf16")
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        out = {}
        for name in ("bf16", "w4a8", "w4a4", "w4a4_packed"):
            model.set_experts_implementation(name)
            out[name] = model(ids).logits
    assert torch.equal(out["w4a4"], out["w4a4_packed"])
    assert not torch.equal(out["w4a8"], out["bf16"])


def test_weight_edit_after_load_drops_the_stored_codes(checkpoint):
    path, _, _ = checkpoint
    model = load_fp4_checkpoint(path)
    experts = model.model.layers[1].mlp.experts
    assert weights.fp4_weights(experts).source == "checkpoint"
    with torch.no_grad():
        experts.down_proj.mul_(2)
    assert weights.fp4_weights(experts).source == "quantized-from-bf16"


def test_hf_adapter_hook_attaches_codes(checkpoint):
    from transformers import AutoModelForCausalLM

    path, _, fp4 = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="w4a4")  # CPU: dequantized
    K.get_kernel("w4a4").prepare_model(model, path)
    assert weights.fp4_weights(model.model.layers[1].mlp.experts).source == "checkpoint"


def test_mismatched_weights_are_refused(checkpoint, tmp_path):
    from evalgate.errors import UserError

    path, _, _ = checkpoint
    model = load_fp4_checkpoint(path)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj.add_(1.0)
    with pytest.raises(UserError, match="do not match"):
        attach_stored_fp4(model, path)


def test_fp8experts_storage_is_used_as_stored(checkpoint):
    """On a GPU (compute capability >= 8.9) transformers keeps FP8Experts with int8 codes and e8m0
    scales; the kernels read those directly. Built by hand here, since this machine has no GPU."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    path, model, fp4 = checkpoint
    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    cfg = model.config
    cfg._experts_implementation = "w4a4_packed"
    fp8 = cls(cfg, scale_fmt="ue8m0", expert_dtype="fp4")
    with torch.no_grad():
        fp8.gate_up_proj.copy_(fp4.w1.view(torch.int8))
        fp8.gate_up_proj_scale_inv.copy_(fp4.w1_scale.view(torch.float8_e8m0fnu))
        fp8.down_proj.copy_(fp4.w2.view(torch.int8))
        fp8.down_proj_scale_inv.copy_(fp4.w2_scale.view(torch.float8_e8m0fnu))
    used = weights.fp4_weights(fp8)
    assert used.source == "fp8experts" and torch.equal(used.w1, fp4.w1)
    bf16_experts = model.model.layers[1].mlp.experts
    x = torch.randn(5, cfg.hidden_size).bfloat16()
    idx = torch.randint(0, 8, (5, 2))
    w = torch.rand(5, 2)
    assert torch.equal(fp8(x, idx, w), K.get_kernel("w4a4_packed").experts_forward(bf16_experts, x, idx, w))
