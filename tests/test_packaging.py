"""The project's `kernels/` folder is `evalgate.kernels`, never the top-level `kernels` that Hugging Face
publishes and transformers probes for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LOAD_DSV4 = """
import sys
from evalgate.model_adapters.hf import load_model
import evalgate.kernels
model, tok = load_model(sys.argv[1], "bf16")
assert type(model).__name__ == "DeepseekV4ForCausalLM"
print("top-level kernels imported:", "kernels" in sys.modules)
print("evalgate.kernels from:", evalgate.kernels.__file__)
"""


def _python(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_loading_dsv4_from_the_repo_root_imports_no_top_level_kernels(tiny_model):
    # -P: the interpreter does not put the current folder on sys.path, as for the `evalgate` console script
    proc = _python(["-P", "-c", LOAD_DSV4, str(tiny_model)], cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "top-level kernels imported: False" in proc.stdout
    assert f"evalgate.kernels from: {REPO / 'kernels' / '__init__.py'}" in proc.stdout


@pytest.mark.slow
def test_with_the_repo_root_on_sys_path_the_folder_stays_inert(tiny_model):
    # `python -c` or a notebook started in the repo root puts it on sys.path; transformers' probe then finds
    # the folder under the name `kernels`. It must register nothing and look like no installed package.
    code = LOAD_DSV4 + """
from transformers.utils.import_utils import is_kernels_available
top = sys.modules.get("kernels")
print("inert:", top is None or not hasattr(top, "get_kernel"))
print("hub kernels available:", is_kernels_available())
"""
    proc = _python(["-c", code, str(tiny_model)], cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "inert: True" in proc.stdout and "hub kernels available: False" in proc.stdout


def test_distribution_maps_the_folders_under_evalgate():
    import evalgate.kernels
    import evalgate.model_adapters

    assert Path(evalgate.kernels.__file__).parent == REPO / "kernels"
    assert Path(evalgate.model_adapters.__file__).parent == REPO / "model_adapters"
