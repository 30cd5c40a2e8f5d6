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
import cli_process

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

    return flash_config(layers=layers, experts=experts, scale=1 / 32, vocab=4096)


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A small DeepSeek-V4-Flash in the released layout (sliding, CSA and HCA layers, hash and score routing,
    the MTP layer) with a BPE tokenizer."""
    from dsv4_flash_fullwidth import tokenizer_for

    from random_fp4 import write_released_checkpoint

    out = tmp_path_factory.mktemp("released") / "model"
    return write_released_checkpoint(out, _small(), tokenizer_for(out), log=lambda s: None)


def test_full_width_header_has_the_released_names_dtypes_and_shapes():
    from dsv4_flash_fullwidth import flash_config

    from random_fp4 import released_config, released_specs

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
    from evalgate.model_adapters.loading.checkpoint_bytes import stored_tensors
    from random_fp4 import released_specs

    written = sorted((t.key, t.shard, t.dtype, t.shape, t.nbytes) for t in stored_tensors(released))
    planned = sorted((t.key, t.shard, t.dtype, t.shape, t.nbytes) for t in released_specs(_small()))
    assert written == planned
    index = json.loads((released / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t[4] for t in written)
    assert set(index["weight_map"]) == {t[0] for t in written}


def test_fp8_block_dequantization_is_exact_in_bf16():
    """code x 2^e is a BF16 value: dequantizing to BF16, FP32 or float64 gives the same numbers, with or
    without partial blocks, and the GPU's broadcast form (``dequantize_fast``) gives them too."""
    from evalgate.kernels.fp8_blocks import dequantize, quantize, scale_grid, scale_values
    from evalgate.model_adapters.canonical.fp8_linear import dequantize_fast

    gen = torch.Generator().manual_seed(3)
    for shape in ((256, 384), (300, 200), (64, 128)):
        w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # blocks of different scales
        codes, scale = quantize(w)
        assert codes.dtype == torch.float8_e4m3fn and tuple(scale.shape) == scale_grid(shape)
        exact = dequantize(codes, scale, torch.float64)
        assert torch.equal(dequantize(codes, scale, torch.bfloat16).double(), exact)
        assert torch.equal(dequantize(codes, scale, torch.float32).double(), exact)
        assert torch.equal(dequantize_fast(codes, scale_values(scale, torch.float32), torch.bfloat16).double(), exact)
        assert torch.equal(dequantize(*quantize(exact.float()), torch.float64), exact)  # on the grid: unchanged
    with pytest.raises(ValueError, match="scale grid"):
        dequantize(codes, torch.cat([scale, scale], dim=1))


def test_a_gpu_dequantization_serves_only_once_it_gave_pytorchs_bits():
    """``fp8_linear.checked``: a kernel is used for a device only if it reproduces the PyTorch path's bits over
    every code and scale; one rounding differently in one weight, or one that raises, is not."""
    from evalgate.model_adapters.canonical import fp8_linear

    exact = lambda codes, scale: fp8_linear._dequantize_torch(codes, scale, torch.bfloat16)  # noqa: E731

    def one_off(codes, scale):
        out = exact(codes, scale).clone()
        out.view(torch.int16)[300, 7000] += 1
        return out

    def raises(codes, scale):
        raise RuntimeError("no kernel for this device")

    assert fp8_linear.checked(exact, "cpu")
    assert not fp8_linear.checked(one_off, "cpu") and not fp8_linear.checked(raises, "cpu")
    codes, scale = fp8_linear._probe("cpu")  # what the check runs over: every code, every scale byte
    assert set(codes.view(torch.uint8).unique().tolist()) == set(range(256)) - {0x7F, 0xFF}
    assert len(scale.unique()) == 255


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-pass Triton dequantization runs on a GPU")
def test_the_gpu_dequantization_gives_the_exact_bits_over_every_scale_and_code():
    """The Triton kernel a GPU forward reads a kept FP8 weight through (``kernels/triton/fp8_dequant.py``): the
    same BF16 bits as ``fp8_blocks.dequantize`` for every non-NaN E4M3 code under every UE8M0 scale (products
    that are BF16 subnormals or overflow included), with partial blocks."""
    from evalgate.kernels.fp8_blocks import dequantize, scale_grid, scale_values
    from evalgate.model_adapters.canonical.fp8_linear import dequantize_fast

    gen = torch.Generator().manual_seed(5)
    for shape in ((256, 256), (300, 200), (4096, 1024)):
        raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x00  # E4M3's NaN codes have no single value to compare
        codes = raw.view(torch.float8_e4m3fn)
        scale = torch.randint(0, 255, scale_grid(shape), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        want = dequantize(codes, scale, torch.bfloat16)
        got = dequantize_fast(codes.cuda(), scale_values(scale, torch.float32).cuda(), torch.bfloat16).cpu()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# --- loading it as released -------------------------------------------------------------------------


def _mislay(src: Path, dst: Path, key: str, change) -> Path:
    """A copy of checkpoint ``src`` whose shard holding ``key`` has ``change(tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(dst / shard)
    change(tensors)
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    return dst


MISLAID = {
    "missing scale": ("layers.2.attn.wq_a.weight", lambda t: t.pop("layers.2.attn.wq_a.scale"),
                      "layers.2.attn.wq_a.weight is FP8 but has no layers.2.attn.wq_a.scale"),
    "BF16 where FP8 is declared": (
        "layers.1.ffn.shared_experts.w2.weight",
        lambda t: (t.pop("layers.1.ffn.shared_experts.w2.scale"),
                   t.update({"layers.1.ffn.shared_experts.w2.weight": torch.zeros(128, 64, dtype=torch.bfloat16)})),
        "layers.1.ffn.shared_experts.w2.weight is BF16 but config.json declares FP8 dense linears"),
    "wrong block grid": ("layers.0.attn.wq_b.weight",
                         lambda t: t.update({"layers.0.attn.wq_b.scale": t["layers.0.attn.wq_b.scale"][:2].clone()}),
                         "layers.0.attn.wq_b.scale has shape [2, 1] for a weight of [512, 32]; expected [4, 1]"),
}


@pytest.mark.parametrize("case", sorted(MISLAID))
def test_a_mislaid_checkpoint_is_refused_naming_the_tensor(case, released, tmp_path):
    from evalgate.model_adapters.loading.released_layout import check_layout

    key, change, message = MISLAID[case]
    bad = _mislay(released, tmp_path / "bad", key, change)
    with pytest.raises(UserError) as exc:
        check_layout(bad)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    check_layout(released)  # the released layout itself passes


def test_streamed_load_equals_transformers_load_and_never_reads_the_mtp_layer(released, monkeypatch):
    import safetensors

    from evalgate.model_adapters.hf.adapter import load_model
    from evalgate.model_adapters.loading.streamed import load_streamed

    reference, _ = load_model(released, "w4a8", numerics="native")
    read = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    streamed = load_streamed(released, "w4a8", "cpu")
    assert read and not [k for k in read if k.startswith("mtp.")]
    ours, theirs = dict(streamed.named_parameters()), dict(reference.named_parameters())
    for name, p in theirs.items():
        if ".experts." not in name:
            assert p.dtype == ours[name].dtype and torch.equal(p, ours[name]), name
    assert ours["model.layers.0.self_attn.sinks"].dtype == torch.float32
    assert ours["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16  # dequantized on a CPU


def test_resident_bytes_count_fp8_as_kept_and_leave_out_the_mtp_layer(released):
    from evalgate.model_adapters.loading.checkpoint_bytes import mtp_bytes, stored_tensors, unit_bytes

    tensors = stored_tensors(released)
    on_gpu, on_cpu = unit_bytes(tensors, keep_fp8=True), unit_bytes(tensors, keep_fp8=False)
    stored = sum(t.nbytes for t in tensors)
    assert mtp_bytes(tensors) > 0 and sum(on_gpu.values()) == stored - mtp_bytes(tensors)  # all as stored
    fp8 = [t for t in tensors if t.dtype == "F8_E4M3" and not t.key.startswith("mtp.")]
    scales = sum(t.nbytes for t in tensors if t.key in {f.key[:-6] + "scale" for f in fp8})
    weights = sum(t.nbytes for t in fp8)
    assert sum(on_cpu.values()) - sum(on_gpu.values()) == weights - scales  # BF16: twice an FP8 weight, no scale
    assert set(on_gpu) == {"prefix", "suffix", "layer.0", "layer.1", "layer.2", "layer.3"}


def test_fp8_kept_gives_the_dequantized_models_bits_canonical_and_native(released):
    """Kept FP8 (as on a GPU) or dequantized at load (as on a CPU), the model computes the same bits in either
    numerics; canonical numerics do not depend on the batch."""
    from dataclasses import replace

    from evalgate.model_adapters.canonical import invariant
    from evalgate.model_adapters.canonical.fp8_linear import is_fp8
    from evalgate.model_adapters.hf.adapter import load_model
    from evalgate.model_adapters.loading.streamed import plan_load, stream_load

    dequantized, tok = load_model(released, "w4a8", numerics="native")
    kept = stream_load(released, "w4a8", replace(plan_load(released, [("cpu", 64 << 30)]), keep_fp8=True))
    assert is_fp8(kept.model.layers[2].self_attn.q_b_proj) and is_fp8(kept.model.layers[0].mlp.shared_experts.up_proj)
    assert kept.model.layers[0].self_attn.q_b_proj.weight_fp8.dtype == torch.float8_e4m3fn
    ids = torch.tensor([tok("Natalia sold clips to 48 of her friends in April")["input_ids"]] * 3)
    with torch.inference_mode():
        assert torch.equal(dequantized(ids).logits, kept(ids).logits)
        for model in (dequantized, kept):
            invariant.install(model)
        batch = kept(ids).logits
        assert torch.equal(dequantized(ids).logits, batch)
        assert torch.equal(kept(ids[:1]).logits[0], batch[2])


def test_held_dequantizations_give_the_same_bits_and_keep_the_reserve_free(released):
    """``hold_dequantized`` (PyTorch's numerics on GPUs) keeps each FP8 weight's dequantization, bit for bit
    what reading ``weight`` computes, the same logits; a device whose free bytes are all reserved holds none."""
    from dataclasses import replace

    from evalgate.model_adapters.canonical.fp8_linear import dequantize_fast, hold_dequantized, is_fp8
    from evalgate.model_adapters.loading.streamed import device_capacities, plan_load, stream_load

    def free(device):
        return device_capacities([device])[0][1]

    def kept():
        return stream_load(released, "w4a8", replace(plan_load(released, [("cpu", 64 << 30)]), keep_fp8=True))

    model, reference = kept(), kept()
    assert hold_dequantized(model, {"cpu": 1 << 62}, free) == 0  # the reserve first
    fp8 = [m for m in model.modules() if is_fp8(m)]
    held = hold_dequantized(model, {"cpu": 0}, free)
    assert held == sum(m.weight_fp8.numel() * 2 for m in fp8) > 0
    for m in fp8:
        assert m.weight is m.weight  # read, not recomputed
        assert torch.equal(m.weight.view(torch.int16), dequantize_fast(m.weight_fp8, m._evalgate_scale_f32,
                                                                       torch.bfloat16).view(torch.int16))
    assert "_evalgate_held" not in str(list(model.state_dict()))  # never saved
    ids = torch.arange(3, 40).view(1, -1)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)


# --- the done-when: `evalgate run` on it, gated against itself -------------------------------------------


def _evalgate(args, env, cwd):

    return cli_process.run([*args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_released_layout_runs_and_gates_against_itself(released, cli_env, tmp_path):
    """`evalgate run` loads the released layout on the CPU (FP8 dense linears dequantized, MTP not read); the
    same kernel at batch 1 and at batch 6 gives the same tokens for every item, so the gate PASSes with 0
    flips; a mis-laid copy is refused in one line naming the tensor, exit 2."""
    from gate_helpers import policy

    common = ["run", "--model", str(released), "--kernel", "w4a8", "--tasks", "gsm8k", "--limit", "6",
              "--max-new-tokens", "6"]
    for name, batch in (("a", "6"), ("b", "1")):
        proc = _evalgate(common + ["--batch-size", batch, "--out", str(tmp_path / name)], cli_env, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = [sorted((r["doc_id"], r["resps"]) for r in map(json.loads, (tmp_path / n / "gsm8k.jsonl").read_text()
                                                              .splitlines())) for n in "ab"]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["model"]["numerics"] == "canonical-v1"
    gate = _evalgate(["gate", "--candidate", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"),
                      "--allow-uncalibrated", "--thresholds", str(policy(tmp_path, rate=50.0))], cli_env,
                     tmp_path)
    assert gate.returncode == 0, gate.stdout[-3000:] + gate.stderr[-3000:]
    assert "verdict: PASS" in gate.stdout and "gsm8k: 0 lost, 0 gained" in gate.stdout

    key, change, message = MISLAID["BF16 where FP8 is declared"]
    bad = _mislay(released, tmp_path / "bad", key, change)
    proc = _evalgate(["run", "--model", str(bad), "--kernel", "w4a8", "--tasks", "gsm8k", "--limit", "1",
                      "--out", str(tmp_path / "c")], cli_env, tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
