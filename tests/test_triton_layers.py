"""DeepSeek-V4 layers as Triton kernels (``model_adapters/fast/triton_layers.py``: the hyper-connection weights,
the RMSNorms) against transformers' own forwards, under Triton's interpreter on a CPU (on a GPU where there
is one). Each check runs in a fresh process (``triton_process``)."""

from __future__ import annotations

import types

import pytest
import torch

from triton_process import needs_triton, run

pytestmark = needs_triton

SETUP = """
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
from evalgate.model_adapters.fast import triton_layers
from evalgate.model_adapters.hf.tiny import tiny_config
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""


def _run(body: str) -> str:
    return run(SETUP, body)


@pytest.mark.parametrize("hc, block, warps, fused_mixes", [(2, 32, 4, False), (4, 32, 4, False), (4, 8, 1, False),
                                                          (2, 32, 4, True), (4, 8, 1, True)])
def test_the_kernel_computes_transformers_weights(hc, block, warps, fused_mixes):
    """pre, post and comb of 70 tokens (three programs of the default 32 tokens, the last one partial; nine
    of 8) for hc streams, from mixes with a large spread, against transformers' module on the same inputs:
    within float rounding, and comb doubly stochastic. ``fused_mixes``: the mixes from the streams in one
    kernel (``hyper_mixes``, as a prefill's tokens take them; 70 tokens are three row blocks, the last
    partial; at hc 2 the 128 inputs a token fill half of the 256-wide input block), else transformers' norm
    and linear."""
    out = _run(f"""
        triton_layers.HYPER.update(block={block}, warps={warps})
        triton_layers.MIXES_ROWS = {0 if fused_mixes else 10**9}
        triton_layers.MIXES["k"] = 256
        fused, hyper_mixes = [], triton_layers.hyper_mixes
        triton_layers.hyper_mixes = lambda *args: fused.append(1) or hyper_mixes(*args)
        torch.manual_seed(0)
        cfg = tiny_config(64, hc_mult={hc})
        module = DeepseekV4HyperConnection(cfg).to(DEVICE)
        with torch.no_grad():
            module.fn.normal_(0, 0.02)
            module.base.normal_(0, 1.0)
            module.scale.copy_(torch.tensor([1.0, 0.5, 4.0]))
        streams = torch.randn(5, 14, {hc}, cfg.hidden_size, device=DEVICE).to(torch.bfloat16) * 3
        with torch.no_grad():
            ref = module(streams)
            triton_layers.install(torch.nn.Sequential(module), force=True)
            got = module(streams)
        assert module.forward.__func__ is triton_layers.hyper_connection_forward  # the kernel ran, no fallback
        for name, a, b in zip(("post", "comb", "collapsed"), got, ref):
            a, b = a.float(), b.float()
            assert a.shape == b.shape, (name, a.shape, b.shape)
            tol = 2e-2 if name == "collapsed" else 1e-5  # collapsed is BF16: one rounding step apart at most
            assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), (name, (a - b).abs().max())
        comb = got[1].float()
        assert torch.allclose(comb.sum(-2), torch.ones_like(comb.sum(-2)), atol=1e-3)
        assert bool(fused) == {fused_mixes}
        print("comb differs by", (got[1] - ref[1]).abs().max().item())
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_a_model_with_the_kernel_gives_transformers_logits():
    """A tiny DeepSeek-V4 model (hc 2) with every hyper-connection on the kernel: its logits are the
    transformers forward's within float rounding, and ``install`` leaves a CPU model alone unless forced."""
    out = _run("""
        from transformers import DeepseekV4ForCausalLM
        torch.manual_seed(1)
        model = DeepseekV4ForCausalLM(tiny_config(200)).eval().to(DEVICE)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, DeepseekV4HyperConnection):
                    module.base.normal_()
                    module.fn.normal_(0, 0.05)
        ids = torch.randint(3, 200, (2, 30), device=DEVICE)
        with torch.no_grad():
            ref = model(input_ids=ids).logits
            if DEVICE == "cpu":
                assert not triton_layers.install(model) and triton_layers.usable(model) == "not on a GPU"
            assert triton_layers.install(model, force=True)
            got = model(input_ids=ids).logits
        bound = [(type(m).__name__, m.forward.__func__) for m in model.modules()
                 if type(m).__name__ in triton_layers.FORWARDS]
        assert {name for name, _ in bound} == set(triton_layers.FORWARDS)
        assert all(f is triton_layers.FORWARDS[name] for name, f in bound)  # every kernel ran, no fallback
        assert not triton_layers._MIX_FAILED
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), (got - ref).abs().max()
        print("ok")
    """)
    assert out.strip().endswith("ok")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("hc,width", [(4, 3000), (2, 200)])
def test_the_mixing_kernels_compute_transformers_streams(dtype, hc, width):
    """``hyper_collapse`` and ``hyper_mix`` against transformers' expressions (the decoder layer's), streams
    with a large spread: the same roundings, so apart by at most a rounding step of the terms where the sums'
    order differs, and in BF16 nearly every element bit-identical. 3000 wide: three programs a token, the last
    partial."""
    out = _run(f"""
        torch.manual_seed(2)
        dtype = torch.{dtype}
        streams = (torch.randn(3, 5, {hc}, {width}, device=DEVICE) * torch.rand(3, 5, {hc}, 1, device=DEVICE) * 8
                   ).to(dtype)
        output = torch.randn(3, 5, {width}, device=DEVICE).to(dtype)
        pre = torch.rand(3, 5, {hc}, device=DEVICE) + 0.1
        post = torch.rand(3, 5, {hc}, device=DEVICE) * 2
        comb = torch.rand(3, 5, {hc}, {hc}, device=DEVICE)
        comb = comb / comb.sum(-1, keepdim=True)
        with torch.no_grad():
            got = [triton_layers.hyper_collapse(pre, streams), triton_layers.hyper_mix(post, comb, output, streams)]
        assert not triton_layers._MIX_FAILED, triton_layers._MIX_FAILED
        ref = [(pre.unsqueeze(-1) * streams).sum(dim=2).to(dtype),
               post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                   streams)]
        # the terms' size: a rounding step of it bounds a different order of the sums (and cancellation)
        h = streams.float().abs()
        size = [(pre.unsqueeze(-1) * h).sum(dim=2),
                post.unsqueeze(-1) * output.float().abs().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), h)]
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
        for name, a, b, scale in zip(("collapse", "mix"), got, ref, size):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype)
            a, b = a.float(), b.float()
            step = 2 * ulp * scale + 1e-30
            assert ((a - b).abs() <= step).all(), (name, ((a - b).abs() / step).max())
            same = (a == b).float().mean().item()
            if dtype == torch.bfloat16:  # BF16 products are exact in FP32: only a sum's order can differ
                assert same >= 0.98, (name, same)
            print(name, "bit-identical", same)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_a_mixing_kernel_that_fails_leaves_transformers_expression():
    """A mixing kernel that cannot build or launch: a warning and transformers' expression for that call and
    every later one (the decoder layer is not run again: its attention has written the cache)."""
    out = _run("""
        import warnings
        from evalgate.model_adapters.fast import triton_hyper_kernel

        class Broken:
            def __getitem__(self, grid):
                raise RuntimeError("no kernel for you")

        triton_hyper_kernel.hyper_mix_kernel = Broken()
        streams = torch.randn(2, 1, 4, 64, device=DEVICE).to(torch.bfloat16)
        output = torch.randn(2, 1, 64, device=DEVICE).to(torch.bfloat16)
        post, comb = torch.rand(2, 1, 4, device=DEVICE), torch.rand(2, 1, 4, 4, device=DEVICE)
        ref = post.to(streams.dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
            comb.to(streams.dtype).transpose(-1, -2), streams)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = triton_layers.hyper_mix(post, comb, output, streams)
            again = triton_layers.hyper_mix(post, comb, output, streams)
        assert torch.equal(got, ref) and torch.equal(again, ref)
        assert [str(w.message) for w in caught if "no kernel for you" in str(w.message)], caught
        assert len(triton_layers._MIX_FAILED) == 1
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_a_kernel_that_fails_hands_the_module_back_to_transformers(monkeypatch):
    """A Triton build or launch error at a module's first call: a warning, transformers' own weights for that
    call, and transformers' forward from then on."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from evalgate.model_adapters.fast import triton_layers
    from evalgate.model_adapters.hf.tiny import tiny_config

    torch.manual_seed(0)
    module = DeepseekV4HyperConnection(tiny_config(64))
    with torch.no_grad():
        module.fn.normal_(0, 0.02)
        module.base.normal_()
        module.scale.fill_(1.0)
    streams = torch.randn(2, 3, 2, 64)
    with torch.no_grad():
        ref = module(streams)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(triton_layers, "hyper_weights", broken)
    module.forward = types.MethodType(triton_layers.hyper_connection_forward, module)
    with torch.no_grad(), pytest.warns(UserWarning, match="no kernel for you"):
        got = module(streams)
    with torch.no_grad():
        again = module(streams)
    assert calls == [1] and all(torch.equal(a, b) for a, b in zip(got, ref)) and all(
        torch.equal(a, b) for a, b in zip(again, ref))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_norm_kernel_computes_transformers_rms_norms(dtype):
    """Weighted (FP32 and BF16 weights) and unweighted RMSNorm over widths of one pass, of a width that is not
    a power of two, and of several passes (wider than NORM_BLOCK): transformers' results within one rounding
    of the output dtype, and no fallback."""
    out = _run(f"""
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm, DeepseekV4UnweightedRMSNorm
        torch.manual_seed(0)
        dtype = torch.{dtype}
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
        for width in (64, 1000, 2 * hyper_kernels.NORM_BLOCK + 3):
            x = (torch.randn(3, 5, width) * torch.linspace(0.01, 30, width)).to(dtype).to(DEVICE)
            for module in (DeepseekV4RMSNorm(width, eps=1e-6), DeepseekV4RMSNorm(width, eps=1e-6).to(torch.bfloat16),
                           DeepseekV4UnweightedRMSNorm(eps=1e-6)):
                module = module.to(DEVICE)
                if hasattr(module, "weight"):
                    with torch.no_grad():
                        module.weight.normal_(1.0, 0.3)
                with torch.no_grad():
                    ref = module(x)
                    hyper_kernels.install(torch.nn.Sequential(module), force=True)
                    got = module(x)
                assert module.forward.__func__ is hyper_kernels.FORWARDS[type(module).__name__]
                assert got.dtype == ref.dtype and got.shape == ref.shape
                err = ((got.float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-3)).max().item()
                assert err <= 2 * ulp, (width, type(module).__name__, err)
        print("ok")
    """.replace("hyper_kernels", "triton_layers"))
    assert out.strip().endswith("ok")


def test_decoding_from_slots_with_the_kernels_gives_transformers_logits():
    """A model with all three attention kinds (FP32), decoded from slots for 12 steps past several window
    closes: with every kernel bound (RoPE in the slot step included) each step's logits are those without
    them, within float rounding; the kernels did run."""
    out = _run("""
        import copy
        from test_attention import _model, VOCAB
        from evalgate.model_adapters.fast import attention_slots
        from evalgate.model_adapters.fast.attention_slots import SlotCache
        plain = _model(index_topk=64, device=DEVICE)
        fused = copy.deepcopy(plain)
        assert triton_layers.install(fused, force=True)
        prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE)
                   for n in (23, 9, 30)]
        caches = []
        for model in (plain, fused):
            cache = SlotCache(model, slots=4, max_length=64)
            with torch.no_grad():
                for slot, p in zip((2, 0, 3), prompts):
                    cache.admit(slot, model(input_ids=p[None], use_cache=True).past_key_values, len(p))
            caches.append(cache)
        assert caches[0].rope is attention_slots.transformers_rope and caches[1].rope is attention_slots.fused_rope
        tokens = torch.tensor([5, 6, 7], device=DEVICE)
        for step in range(12):
            with torch.no_grad():
                a, b = (c.decode_step(tokens, [2, 0, 3]) for c in caches)
            assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item(), (step, (a - b).abs().max())
            tokens = a.argmax(-1)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_the_rope_kernel_is_transformers_rope():
    """rope_step against apply_rotary_pos_emb for queries (many heads, a transposed layout), a single key,
    and the inverse rotation (-sin), in BF16 and FP32: within two roundings of the dtype at the scale of the
    terms each output sums (x cos + x' sin: where they cancel, a fused multiply-add on a GPU keeps bits the
    two roundings lose, so an error relative to the small result says nothing)."""
    out = _run("""
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
        torch.manual_seed(0)
        for dtype in (torch.bfloat16, torch.float32):
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
            for heads, d, half, sign in ((8, 96, 16, 1.0), (1, 96, 16, 1.0), (8, 64, 32, -1.0), (3, 32, 16, 1.0)):
                x = torch.randn(5, 1, heads, d).to(dtype).to(DEVICE).transpose(1, 2)  # [b, H, 1, D], strided
                angle = torch.randn(5, 1, half, device=DEVICE) * 3
                cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
                ref = apply_rotary_pos_emb(x, cos, sin * sign)
                got = triton_layers.rope_step(x, cos, sin, sign)
                assert got.shape == ref.shape and got.dtype == ref.dtype
                terms = 2 * x[..., d - 2 * half:].float().abs().amax(dim=-1, keepdim=True)  # |x cos| + |x' sin| <=
                err = ((got.float() - ref.float()).abs() / terms.clamp(min=1e-2)).max().item()
                assert err <= 2 * ulp, (dtype, heads, d, half, sign, err)
                assert torch.equal(got[..., :d - 2 * half], x[..., :d - 2 * half])  # the nope channels as they were
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_a_rope_kernel_that_fails_hands_the_step_back_to_transformers(monkeypatch):
    """A Triton failure in the slot step's RoPE: a warning once, transformers' rotation then and after."""
    from evalgate.model_adapters.fast import attention_slots, triton_layers

    monkeypatch.setattr(attention_slots, "_ROPE_FAILED", [])
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no rope kernel")

    monkeypatch.setattr(triton_layers, "rope_step", broken)
    x = torch.randn(2, 3, 1, 16)
    angle = torch.randn(2, 1, 4)
    ref = attention_slots.transformers_rope(x, angle.cos(), angle.sin(), -1.0)
    with pytest.warns(UserWarning, match="no rope kernel"):
        first = attention_slots.fused_rope(x, angle.cos(), angle.sin(), -1.0)
    second = attention_slots.fused_rope(x, angle.cos(), angle.sin(), -1.0)
    assert calls == [1] and torch.equal(first, ref) and torch.equal(second, ref)
