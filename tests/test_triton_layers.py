"""DeepSeek-V4 layers as Triton kernels (``model_adapters/triton_layers.py``: the hyper-connection weights,
the RMSNorms) against transformers' own forwards, under Triton's interpreter on a CPU (on a GPU where there
is one).

Triton reads TRITON_INTERPRET when it is first imported, and a test session may have imported it already
(transformers can), so each check runs in a fresh process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: pip install triton (its interpreter runs on a CPU)")

SETUP = """
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
from evalgate.model_adapters import triton_layers
from evalgate.model_adapters.tiny import tiny_config
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""


def _run(body: str) -> str:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    script = SETUP + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("hc", [2, 4])
def test_the_kernel_computes_transformers_weights(hc):
    """pre, post and comb of 70 tokens (three programs, the last one partial) for hc streams, from mixes
    with a large spread, against transformers' module on the same inputs: within float rounding, and comb
    doubly stochastic."""
    out = _run(f"""
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
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), (got - ref).abs().max()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_a_kernel_that_fails_hands_the_module_back_to_transformers(monkeypatch):
    """A Triton build or launch error at a module's first call: a warning, transformers' own weights for that
    call, and transformers' forward from then on."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from evalgate.model_adapters import triton_layers
    from evalgate.model_adapters.tiny import tiny_config

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
