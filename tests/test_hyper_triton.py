"""The hyper-connection weights as one Triton kernel (``model_adapters/hyper_triton.py``) against transformers'
``DeepseekV4HyperConnection.forward``, under Triton's interpreter on a CPU (on a GPU where there is one).

Triton reads TRITON_INTERPRET when it is first imported, and a test session may have imported it already
(transformers can), so each check runs in a fresh process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: pip install triton (its interpreter runs on a CPU)")

SETUP = """
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
from evalgate.model_adapters import hyper_triton
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
            hyper_triton.install(torch.nn.Sequential(module), force=True)
            got = module(streams)
        assert module.forward.__func__ is hyper_triton.hyper_connection_forward  # the kernel ran, no fallback
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
                assert not hyper_triton.install(model) and hyper_triton.usable(model) == "not on a GPU"
            assert hyper_triton.install(model, force=True)
            got = model(input_ids=ids).logits
        bound = [m.forward.__func__ for m in model.modules() if isinstance(m, DeepseekV4HyperConnection)]
        assert bound and all(f is hyper_triton.hyper_connection_forward for f in bound)  # no fallback
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), (got - ref).abs().max()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_a_kernel_that_fails_hands_the_module_back_to_transformers(monkeypatch):
    """A Triton build or launch error at a module's first call: a warning, transformers' own weights for that
    call, and transformers' forward from then on."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from evalgate.model_adapters import hyper_triton
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

    monkeypatch.setattr(hyper_triton, "hyper_weights", broken)
    hyper_triton.install(torch.nn.Sequential(module), force=True)
    with torch.no_grad(), pytest.warns(UserWarning, match="no kernel for you"):
        got = module(streams)
    with torch.no_grad():
        again = module(streams)
    assert calls == [1] and all(torch.equal(a, b) for a, b in zip(got, ref)) and all(
        torch.equal(a, b) for a, b in zip(again, ref))
