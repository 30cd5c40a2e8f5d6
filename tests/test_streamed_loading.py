"""Loading FP4 checkpoints at scale (issue 15, item 2): the placement planner (pure, made-up devices), the
streamed loader (the same model as transformers' load, experts kept packed, never dequantized) and the
full-width DeepSeek-V4-Flash benchmark script at a tiny scale."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import evalgate.kernels.catalogs  # noqa: F401  (registers the kernels)
from evalgate.errors import UserError
from evalgate.model_adapters.loading.placement import GiB, Reserve, parse_device_map, plan

pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[1]


# --- the planner ------------------------------------------------------------------------------------


def _sizes(layers: int, per_layer: float, ends: float = 1.0) -> dict[str, int]:
    return {"prefix": int(ends * GiB), **{f"layer.{i}": int(per_layer * GiB) for i in range(layers)},
            "suffix": int(ends * GiB)}


def test_fits_on_one_device():
    p = plan(_sizes(4, 3.0), [("cuda:0", 139 * GiB)], Reserve(workspace=4 * GiB))
    assert p.devices == ["cuda:0"]
    assert p.per_device["cuda:0"] == 14 * GiB
    assert p.reserve_per_device["cuda:0"] == 4 * GiB


def test_does_not_fit_says_bytes_needed_and_available():
    sizes = _sizes(43, 3.44, ends=0.99)  # DeepSeek-V4-Flash: 150.7 GiB
    with pytest.raises(UserError) as exc:
        plan(sizes, [("cuda:0", 139 * GiB)], Reserve(workspace=4 * GiB))
    msg = str(exc.value)
    assert "\n" not in msg
    assert "needs 153.90 GiB" in msg and "149.90 GiB of weights over 43 layers" in msg
    assert "available: cuda:0 139.00 GiB" in msg
    assert "reserve 4.00 GiB workspace" in msg


def test_kv_reserve_counts_layers_per_device():
    r = Reserve(workspace=GiB, kv_per_token_layer=2048, tokens=1024)
    assert r.on_device(10) == GiB + 2048 * 1024 * 10
    with pytest.raises(UserError, match="KV 2048 B/token/layer x 1024 tokens"):
        plan(_sizes(2, 1.0), [("cpu", 3 * GiB)], r)


def test_multi_device_placement_is_contiguous_and_balanced():
    sizes = _sizes(43, 3.44, ends=0.99)
    p = plan(sizes, [("cuda:0", 139 * GiB), ("cuda:1", 139 * GiB)], Reserve(workspace=4 * GiB))
    assert p.devices == ["cuda:0", "cuda:1"]
    assert p.units["prefix"] == "cuda:0" and p.units["suffix"] == "cuda:1"
    layer_devs = [p.device_of_layer(i) for i in range(43)]
    assert layer_devs == sorted(layer_devs)  # one cut: contiguous runs in forward order
    assert abs(p.per_device["cuda:0"] - p.per_device["cuda:1"]) <= 4 * GiB  # balanced
    for d in p.devices:
        assert p.per_device[d] + p.reserve_per_device[d] <= 139 * GiB


def test_balanced_falls_back_to_filling_in_order():
    # unequal devices: balancing by halves would overflow the small one, filling in order fits
    sizes = _sizes(6, 10.0, ends=0.5)
    p = plan(sizes, [("cuda:0", 55 * GiB), ("cuda:1", 20 * GiB)], Reserve(workspace=GiB))
    assert sum(p.device_of_layer(i) == "cuda:0" for i in range(6)) == 5
    with pytest.raises(UserError, match="cuda:0 55.00 GiB, cuda:1 10.00 GiB"):
        plan(sizes, [("cuda:0", 55 * GiB), ("cuda:1", 10 * GiB)], Reserve(workspace=GiB))


def test_a_layer_larger_than_any_device_is_refused():
    with pytest.raises(UserError, match="largest part layer.0 50.00 GiB"):
        plan({"prefix": GiB, "layer.0": 50 * GiB, "suffix": GiB}, [("cuda:0", 40 * GiB), ("cuda:1", 40 * GiB)],
             Reserve(workspace=GiB))


def test_device_map_values():
    assert parse_device_map(None) is None
    assert parse_device_map("auto") == ["auto"]
    assert parse_device_map("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    with pytest.raises(UserError, match="unknown device 'gpu0'"):
        parse_device_map("gpu0")


def test_plan_load_refuses_before_reading_any_tensor(tmp_path):
    """The canary against a device of 1 MiB: refused from its headers alone, one line, with the figures."""
    from evalgate.canary import canary_path
    from evalgate.model_adapters.loading.streamed import plan_load

    with pytest.raises(UserError) as exc:
        plan_load(canary_path(), [("cuda:0", 1 << 20)], reserve=Reserve(workspace=0))
    assert "needs 0.01 GiB" in str(exc.value) and "available: cuda:0 0.00 GiB" in str(exc.value)


# --- the streamed loader ----------------------------------------------------------------------------


def _floating(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point and t.dtype != torch.float8_e8m0fnu  # UE8M0 scales are bytes


class _Watch(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator that computes floating-point data from int8/uint8 data (a dequantization), and every
    floating-point tensor of rank 3 or more (a stacked expert weight), on a real device. Reinterpreting
    stored bytes (``view(dtype)``: safetensors hands BF16 and UE8M0 tensors over that way) computes nothing."""

    def __init__(self):
        super().__init__()
        self.dequantized, self.float3d = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        real = [o for o in outs if o.device.type != "meta"]
        if (func is not torch.ops.aten.view.dtype and any(i.dtype in (torch.int8, torch.uint8) for i in ins)
                and any(_floating(o) for o in real)):
            self.dequantized.append(str(func))
        self.float3d += [(str(func), tuple(o.shape)) for o in real if _floating(o) and o.dim() >= 3]
        return out


@pytest.fixture(scope="module")
def canary_pair():
    from evalgate.canary import canary_path
    from evalgate.model_adapters.hf.adapter import load_model

    ref, tok = load_model(canary_path(), "w4a4_packed")  # transformers' load (dequantized, codes attached)
    watch = _Watch()
    with watch:
        streamed, _ = load_model(canary_path(), "w4a4_packed", device_map="cpu")
    return ref, streamed, tok, watch


def test_streamed_model_is_the_same_model(canary_pair):
    from evalgate.kernels.weights import fp4_weights

    ref, streamed, _, _ = canary_pair
    a = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    b = {**dict(streamed.named_parameters()), **dict(streamed.named_buffers())}
    for key, t in a.items():
        if ".experts." in key:
            continue
        assert b[key].dtype == t.dtype and torch.equal(b[key], t), key
    for layer in range(3):
        x, y = ref.model.layers[layer].mlp.experts, streamed.model.layers[layer].mlp.experts
        fx, fy = fp4_weights(x), fp4_weights(y)
        assert fy.source == "fp8experts"  # read as stored from the packed parameters
        for name in ("w1", "w1_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(fx, name), getattr(fy, name)), (layer, name)


def test_streamed_load_never_dequantizes_an_expert(canary_pair):
    _, streamed, _, watch = canary_pair
    assert watch.dequantized == []
    assert watch.float3d == []
    for name, p in streamed.named_parameters():
        if ".experts." in name:
            assert p.dtype in (torch.int8, torch.uint8), name
    assert streamed._evalgate_placement.devices == ["cpu"]


def test_streamed_model_generates_the_same_tokens(canary_pair):
    from evalgate.model_adapters.hf.generation import decode
    from evalgate.canary import PROFILES
    from evalgate.tasks import get_task, resolve_profile

    ref, streamed, tok, _ = canary_pair
    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, PROFILES["gsm8k"]), None, 6)
    reqs = task.requests(items, resolved)
    args = ([r.prompt for r in reqs], [tuple(r.stop) for r in reqs], [24] * len(reqs))
    a = decode(ref, tok, *args)
    b = decode(streamed, tok, *args)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert any(len(g.token_ids) > 3 for g in a)


def test_bf16_kernel_is_refused_with_a_device_map():
    from evalgate.canary import canary_path
    from evalgate.model_adapters.hf.adapter import load_model

    with pytest.raises(UserError, match="BF16 experts"):
        load_model(canary_path(), "bf16", device_map="cpu")


def test_cli_refuses_a_model_that_does_not_fit(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from evalgate.cli.main import main as cli
    from evalgate.model_adapters.loading import streamed

    monkeypatch.setattr(streamed, "device_capacities", lambda devices: [(d, 1 << 20) for d in devices])
    result = CliRunner().invoke(cli, ["run", "--kernel", "w4a4_packed", "--device-map", "cpu", "--limit", "1",
                                      "--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert "does not fit" in result.output and "available: cpu 0.00 GiB" in result.output


# --- the full-width script, tiny --------------------------------------------------------------------


@pytest.mark.slow
def test_fullwidth_script_tiny(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import dsv4_flash_fullwidth as script

    figures = script.main(["--out", str(tmp_path / "ckpt"), "--scale", "0.02", "--layers", "4", "--experts", "8",
                           "--device-map", "cpu", "--items", "1", "--batch-size", "1", "--max-new-tokens", "2",
                           "--batches", "1,3", "--steps", "1", "--gate-reps", "1", "--projection-items", "4",
                           # the canary's zero-shot prompts: every path of the script at a fraction of few-shot
                           # prompts' prefill time on a CPU
                           "--gsm8k-profile", "gsm8k-canary-v1"])
    assert figures["layers"] == 4 and figures["tokens"] == 2
    assert figures["config"]["n_routed_experts"] == 8 and figures["config"]["num_hidden_layers"] == 43
    assert figures["h200s_needed"] == 1 and figures["projected_gsm8k_s_full_model"] > 0
    rows = figures["batches"]
    assert [(r["cache"], r["batch"]) for r in rows] == [("hf", 1), ("hf", 3), ("slots", 1), ("graphs", 1),
                                                         ("slots", 3), ("graphs", 3)]
    assert figures["copy_bandwidth_gb_s"] > 0
    by = {(r["cache"], r["batch"]): r for r in rows}
    assert all(by["graphs", b]["graph_bits_equal"] and not by["graphs", b]["graphed"] for b in (1, 3))  # CPU
    # the slots' prefill rate leaves out the first, untimed prefill, which the rows carry apart
    assert all(by[c, b]["warmup_s"] > 0 for c in ("slots", "graphs") for b in (1, 3))
    # and every prompt prefilled again, each timed alone
    assert all(by[c, 3]["prefill_again_ms"] > 0 for c in ("slots", "graphs"))
    assert by["slots", 3]["prefill_first_ms"] > 0 and by["slots", 3]["prefill_device_allocations"] == 0
    assert by["slots", 3]["prefill_again_tokens_per_s"] > 0 and by["slots", 3]["prefill_once_s"] >= 0
    for one, three in ((by[c, 1], by[c, 3]) for c in ("hf", "slots", "graphs")):
        assert three["prompt_tokens"] > 3 * 20  # the prompts, prefilled
        # a step of 3 rows reads at least the experts of 1 row: its floor is at least batch 1's
        assert three["floor_gib"] >= one["floor_gib"] > 0 and one["x_floor"] > 0
        # 4 H200s hold 4 copies of a model that needs 1, 2 hold 2: the items take half as long, the once-costs not
        # (minutes rounded to 0.1: once-costs of seconds vanish beside the hours a CPU's items take)
        assert three["gate_min_2_h200"] / 2 <= three["gate_min_4_h200"] < three["gate_min_2_h200"]
    projection = figures["gate_projection"]  # the whole gate, priced (tests/test_gate_projection.py: its arithmetic)
    assert [t["name"] for t in projection["tasks"]] == ["gsm8k", "humaneval"] and projection["rounds"]["round_ks"]
    assert {(r["lengths"], r["gpus"]) for r in projection["table"]} == {(x, g) for x in ("expected", "limit") for g in (2, 4)}
    assert not (tmp_path / "ckpt").exists()  # deleted unless --keep


def test_fullwidth_config_is_dsv4_flash(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import dsv4_flash_fullwidth as script
    from evalgate.model_adapters.loading.streamed import default_reserve

    cfg = script.flash_config()
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.num_hidden_layers) == (4096, 2048, 256, 6, 43)
    assert cfg.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    assert cfg.layer_types[:4] == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                   "heavily_compressed_attention"]
    sizes = script.unit_bytes_of(cfg)
    per_layer_experts = 256 * 3 * 4096 * 2048 * 17 // 32
    assert sizes["layer.3"] > per_layer_experts
    assert 150 * GiB < sum(sizes.values()) < 152 * GiB
    assert script.h200s_needed(sizes, default_reserve(cfg.to_dict(), "bfloat16", 16 * 2048)) == 2


def test_conformance_reads_the_packed_experts_as_the_loaded_ones(canary_pair):
    """The kernel conformance check on a streamed model (packed int8 experts): the same verdicts and numbers
    as on transformers' load of the same checkpoint."""
    from evalgate.kernels.conformance import model_conformance

    ref, streamed, tok, _ = canary_pair
    prompts = [tok("Question: 2 + 3 = ?\nAnswer:", return_tensors="pt").input_ids[0]]
    for name in ("w4a4_packed", "faulty/w4a4_packed-weight-after-requant"):
        a, b = model_conformance(ref, name, prompts), model_conformance(streamed, name, prompts)
        assert (a.ok, a.calc_diff, a.differing) == (b.ok, b.calc_diff, b.differing), name
    assert not model_conformance(streamed, "faulty/w4a4_packed-weight-after-requant", prompts).ok


def test_floor_counts_the_experts_a_step_routes_to(monkeypatch):
    """RoutedExperts records each MoE layer's distinct routed experts, as the router chose them."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import dsv4_flash_fullwidth as script
    from transformers import DeepseekV4ForCausalLM

    from evalgate.model_adapters.hf.tiny import fill_hash_routes, tiny_config

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(tiny_config(100, num_hidden_layers=2)).eval()
    fill_hash_routes(model, 0)
    ids = torch.tensor([[5, 9, 13]])
    chosen = []
    router = model.model.layers[1].mlp.gate
    router.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
    with torch.no_grad(), script.RoutedExperts(model) as routed:
        model(input_ids=ids)
    hashed = model.model.layers[0].mlp.gate.tid2eid[ids.flatten()]
    assert routed.distinct == [len(torch.unique(hashed)), len(torch.unique(chosen[0]))]
    experts = model.model.layers[1].mlp.experts
    per_expert = sum(p.numel() * p.element_size() for p in experts.parameters()) // experts.gate_up_proj.shape[0]
    assert routed.bytes() == sum(routed.distinct) * per_expert
