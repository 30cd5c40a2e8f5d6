"""The project's `kernels/` folder is `evalgate.kernels`, never the top-level `kernels` that Hugging Face
publishes and transformers probes for; a built install carries the top-level thresholds.yaml as its default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LOAD_DSV4 = """
import sys
from evalgate.model_adapters.hf.adapter import load_model
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


# --- the default policy: the top-level thresholds.yaml, built into an install as package data ----------------

INSTALLED = """
import sys
from pathlib import Path
from evalgate.gate.policy import default_thresholds_path, resolve_policy
policy = resolve_policy(None)
print(Path(sys.modules["evalgate"].__file__).parent)
print(default_thresholds_path())
print(policy.source, policy.path, policy.sha256)
"""


def test_a_built_install_ships_the_top_level_policy(tmp_path):
    # a non-editable install: build a wheel from the sources git tracks, install it into a fresh venv (its
    # dependencies from this interpreter's site-packages) and ask from an empty directory, then from one
    # holding its own thresholds.yaml
    import hashlib
    import os
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "thresholds.yaml"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("evalgate", "kernels", "model_adapters"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("evalgate-*.whl")
    policy_bytes = (REPO / "thresholds.yaml").read_bytes()
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        assert [n for n in names if n.startswith("evalgate/policy_default/")] == ["evalgate/policy_default/thresholds.yaml"]
        assert whl.read("evalgate/policy_default/thresholds.yaml") == policy_bytes
        assert not [n for n in names if n.endswith("thresholds.yaml") and "policy_default" not in n]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("EVALGATE_THRESHOLDS", "PYTHONPATH")}
    empty = tmp_path / "empty"
    empty.mkdir()

    def ask(cwd):
        proc = subprocess.run([str(python), "-P", "-c", INSTALLED], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    package, default, chosen = ask(empty)
    assert Path(package).is_relative_to(venv) and not Path(package).is_relative_to(REPO)
    assert Path(default) == Path(package) / "policy_default" / "thresholds.yaml"
    assert chosen == f"packaged default {default} {hashlib.sha256(policy_bytes).hexdigest()}"
    (empty / "thresholds.yaml").write_bytes(policy_bytes.replace(b"margin_pp: 1.5", b"margin_pp: 2.0"))
    _, _, chosen = ask(empty)
    assert chosen.startswith(f"./thresholds.yaml {empty / 'thresholds.yaml'} ")
