"""The example kernel package: what evalgate reads of it is light, the CPU path computes the declared recipe
bit for bit on synthetic layers (evalgate's own conformance check holds it on the model), and its fault and its
B200 path are told apart from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evalgate.kernels import check
from evalgate.kernels.emulator import experts_forward as emulation
from evalgate_example_kernel import cpu, declarations

ROOT = Path(__file__).resolve().parents[1]


def test_the_declarations_import_without_torch():
    code = ("import sys; import evalgate_example_kernel.declarations as d; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(d.CPU.name)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "example/w4a4_packed-cpu", proc.stderr


def test_every_declaration_checks():
    for spec in (declarations.CPU, declarations.B200, declarations.FAULTY_TIES):
        assert spec.checked("the example").recipe == declarations.PACKED_W4A4


@pytest.fixture(scope="module", params=[("tiny", 64, 0), ("tiny", 128, 1)])
def layer(request):
    shape, tokens, seed = request.param
    case = check.synthetic_layer(shape, tokens, seed)
    return case, check.Fp4ExpertsModule(case.weights, case.limit, "cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_the_cpu_path_is_the_declared_recipe_bit_for_bit(layer):
    case, module = layer
    idx = case.top_k_index.clone()
    idx[0, -1] = case.weights.num_experts  # an empty slot adds nothing
    reference = emulation(declarations.PACKED_W4A4)(module, case.x, idx, case.top_k_weights)
    assert torch.equal(_bits(cpu.experts_forward(module, case.x, idx, case.top_k_weights)), _bits(reference))


def test_the_fault_differs_where_the_input_sits_on_a_tie(layer):
    case, module = layer
    right = cpu.experts_forward(module, case.x, case.top_k_index, case.top_k_weights)
    wrong = cpu.ties_even_forward(module, case.x, case.top_k_index, case.top_k_weights)
    assert not torch.equal(_bits(right), _bits(wrong))


def test_the_b200_path_declares_what_it_needs():
    capability = declarations.B200.capability
    assert capability.devices == ("cuda",) and capability.arches == (10,) and capability.module == "deep_gemm"
    if capability.missing_library() is None:
        pytest.skip("deep_gemm is installed here: its path runs on the B200")
    assert "deep_gemm" in capability.missing_library()
    assert "runs on cuda, not cpu" in capability.missing_device("cpu")
