"""`evalgate kernels list` and `evalgate kernels check` through the command line."""

import json

import pytest
from click.testing import CliRunner

from evalgate.cli.main import main

def _run(*args):
    return CliRunner().invoke(main, ["kernels", *args])


def test_list_json_has_identity_serving_and_recipe():
    from evalgate.model_adapters.server.engines import TABLE, Selection

    res = _run("list", "--json")
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)}
    # how a server selects a kernel comes from the engine table alone, one line per row that serves it
    for name, row in rows.items():
        serving = [t for t in TABLE if isinstance(t.kernels.get(name), Selection)]
        assert len(row["served_by"]) == len(serving), name
    (packed,) = rows["w4a4_packed"]["served_by"]
    assert packed.startswith("sglang 0.5.12 to before 0.5.19, sgl-deep-gemm 0.1.0 to before 0.1.7: ")
    assert "DG_MEGA_MOE_FP4=1" in packed and "DG_USE_FP4_ACTS=1" in packed and "--moe-a2a-backend megamoe" in packed
    assert rows["w4a4_te"]["served_by"] == [
        f"sglang {span}, sgl-deep-gemm >= 0.2.0: --moe-a2a-backend megamoe --enable-w4a4-mxfp4-megamoe"
        for span in ("0.5.19 to before 0.5.22", ">= 0.5.22")]
    assert any("computes w4a8_sglang" in line for line in rows["w4a8"]["served_by"])
    assert rows["faulty/w4a4_packed-drop-slot"]["served_by"] == [] and "env" not in rows["w4a4"]
    assert rows["w4a4_packed"]["recipe"]["activations"] == "e2m1"
    assert rows["w4a8"]["recipe"]["activations"] == "e4m3"
    assert rows["bf16"]["faulty"] is False and rows["faulty/w4a4_packed-drop-slot"]["faulty"] is True
    healthy = _run("list", "--json", "--no-faulty")
    assert not any(r["faulty"] for r in json.loads(healthy.output))


def test_list_table():
    res = _run("list")
    assert res.exit_code == 0 and "w4a4_packed" in res.output and "--enable-w4a4-mxfp4-megamoe" in res.output


def test_layer_check_tiny_json():
    res = _run("check", "--shape", "tiny", "--tokens", "32", "--kernels", "bf16,w4a8,w4a4", "--json")
    assert res.exit_code == 0, res.output
    rows = {r["kernel"]: r for r in json.loads(res.stdout)["rows"]}  # stderr: progress lines of a long check
    assert rows["bf16"]["rel_rmse"] < rows["w4a8"]["rel_rmse"] < rows["w4a4"]["rel_rmse"]


@pytest.mark.parametrize("args,needle", [
    ((), "exactly one of --shape"),
    (("--shape", "huge"), "unknown shape"),
    (("--shape", "tiny", "--tokens", "many"), "--tokens must be an integer"),
    (("--shape", "tiny", "--kernels", "w4a3"), "unknown kernel"),
    (("--model", "/nonexistent/model"), "does not exist; pass --model a local transformers checkpoint folder"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    res = _run("check", *args)
    assert res.exit_code == 2
    assert needle in res.output


@pytest.mark.slow
def test_model_check_on_a_tiny_checkpoint(tmp_path, data_dir):
    from evalgate.model_adapters.hf.tiny import build_tiny_model

    texts = [json.loads(line)["question"] for line in (data_dir / "gsm8k" / "train.jsonl").read_text().splitlines()[:300]]
    path = build_tiny_model(tmp_path / "m", texts, vocab_size=400)
    res = _run("check", "--model", str(path), "--tasks", "gsm8k", "--limit", "2", "--data-dir", str(data_dir),
               "--kernels", "bf16,w4a4_packed,faulty/w4a4_packed-fp8-layout", "--json")
    assert res.exit_code == 0, res.output
    rows = {r["kernel"]: r for r in json.loads(res.output)["rows"]}
    assert rows["bf16"]["mean_kl"] == 0.0 and rows["bf16"]["top1_agreement"] == 1.0
    assert rows["faulty/w4a4_packed-fp8-layout"]["mean_kl"] > rows["w4a4_packed"]["mean_kl"] > 0
