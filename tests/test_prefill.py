"""One prompt's prefill with the MoE's host sync deferred to its end (``model_adapters/prefill.py``): a tiny
DeepSeek-V4 model whose experts run the Triton path (Triton's interpreter on a CPU, the GPU where there is
one) prefills to the same bits deferred as not, and a prefill whose fast path left rows runs again. Each
check runs in a fresh process (``triton_process``)."""

from __future__ import annotations

import torch

from triton_process import needs_triton, run

pytestmark = needs_triton

SETUP = """
import torch
from evalgate.kernels.tiny_model import tiny_deepseek_v4
from evalgate.kernels.triton import dispatch, moe
from evalgate.model_adapters import prefill
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
import os
os.environ[dispatch.BACKEND_ENV] = "triton"
model = tiny_deepseek_v4(seed=2, layers=3).to(DEVICE)
model.set_experts_implementation("w4a4_packed")
ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(0)).tolist()


def bits(out):
    '''The logits and every tensor of the cache, as integers.'''
    tensors = [out.logits]
    for layer in out.past_key_values.layers:
        tensors += [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    return [t.reshape(-1).contiguous().view(torch.uint8).cpu() for t in tensors]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
"""


def test_a_deferred_prefill_gives_the_synced_prefills_bits():
    out = run(SETUP, """
    added, add = [], moe.DeferredLayers.add
    moe.DeferredLayers.add = lambda self, layer: (added.append(layer), add(self, layer))
    with torch.no_grad():
        synced = bits(prefill.prefill_alone(model, ids, DEVICE, defer=False))
        assert not added
        deferred = bits(prefill.prefill_alone(model, ids, DEVICE, defer=True))
    assert len(synced) > 3
    print(same(synced, deferred), len(added), prefill.STATS)
    """)
    assert out.split()[:2] == ["True", "3"], out  # the three layers' experts deferred their finish
    assert "'deferred': 1, 'again': 0" in out, out


def test_a_prefill_whose_fast_path_left_rows_runs_again():
    """Every layer deferred its rows' finish and one counted rows its fast path left: the prompt is prefilled
    again with every layer finishing (the same bits as a prefill that never deferred)."""
    out = run(SETUP, """
    calls = []
    model.register_forward_hook(lambda *a: calls.append(bool(moe._DEFERRED)))
    moe.DeferredLayers.slow_rows = lambda self, device: torch.ones((), dtype=torch.int32, device=device)
    with torch.no_grad():
        synced = bits(prefill.prefill_alone(model, ids, DEVICE, defer=False))
        calls.clear()
        again = bits(prefill.prefill_alone(model, ids, DEVICE, defer=True))
    print(same(synced, again), calls, prefill.STATS)
    """)
    assert out.split()[0] == "True", out
    assert "[True, False]" in out and "'again': 1" in out, out


def test_a_prefill_defers_only_on_a_gpu_with_pytorchs_numerics():
    out = run(SETUP, """
    from evalgate.model_adapters import invariant
    print(prefill.defers(model, DEVICE), prefill.defers(model, "cpu"))
    invariant.install(model)
    print(prefill.defers(model, DEVICE))
    """)
    assert out.split() == [str(torch.cuda.is_available()), "False", "False"], out
