"""The in-process adapter: kernel chosen through transformers' experts interface, batch-invariant greedy
decoding (canonical numerics, tests/test_invariance.py), stop strings per sequence, cached decoding equal to
a full forward pass."""

from __future__ import annotations

import pytest
import torch

from evalgate.errors import UserError
from evalgate.model_adapters.hf.generation import cut_at_stop, greedy_generate
from evalgate.model_adapters.hf.adapter import HFAdapter, load_model
from evalgate.types import Request

PROMPTS = [
    "Question: Natalia sold clips to 48 of her friends in April.\nAnswer:",
    "Question: Weng earns $12 an hour.\nAnswer:",
    "Q: short\nA:",
    "Question: Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs.\nAnswer:",
]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    return load_model(tiny_model, "bf16")


def test_kernel_is_selected_through_the_experts_interface(model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert model.config._experts_implementation == "bf16"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert "bf16" in ALL_EXPERTS_FUNCTIONS


def test_same_outputs_whatever_the_batch_size(model_and_tokenizer):
    model, tok = model_and_tokenizer
    stops = [("Question:",)] * len(PROMPTS)
    together = greedy_generate(model, tok, PROMPTS, stops, [24] * len(PROMPTS))
    pairs = greedy_generate(model, tok, PROMPTS[:2], stops[:2], [24, 24]) + greedy_generate(model, tok, PROMPTS[2:], stops[2:], [24, 24])
    alone = [greedy_generate(model, tok, [p], [s], [24])[0] for p, s in zip(PROMPTS, stops)]
    for a, b, c in zip(together, pairs, alone):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.text == c.text and a.finish_reason == c.finish_reason


def test_cached_decoding_matches_a_full_forward(model_and_tokenizer):
    model, tok = model_and_tokenizer
    out = greedy_generate(model, tok, [PROMPTS[0]], [()], [16])[0]
    ids = tok(PROMPTS[0], add_special_tokens=False)["input_ids"] + out.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    n = len(out.token_ids)
    # greedy tokens from the cache are the argmax of a full, uncached forward pass
    assert logits[-n - 1:-1].argmax(-1).tolist() == out.token_ids


def test_stop_strings_cut_each_sequence(model_and_tokenizer):
    model, tok = model_and_tokenizer
    free = greedy_generate(model, tok, PROMPTS[:2], [(), ()], [20, 20])
    # pick a stop string that occurs mid-way in the first sequence's free output
    text = free[0].text
    stop = text[5:8]
    if not stop.strip():
        pytest.skip("degenerate free text")
    out = greedy_generate(model, tok, PROMPTS[:2], [(stop,), ()], [20, 20])
    assert out[0].finish_reason == "stop" and out[0].stop_hit == stop
    assert out[0].text == text[: text.find(stop)] and stop not in out[0].text
    assert out[1].text == free[1].text and out[1].finish_reason == "length"
    assert len(out[1].token_ids) == 20


def test_cut_at_stop_takes_the_earliest():
    assert cut_at_stop("a\nclass b\ndef c", ("\ndef", "\nclass")) == ("a", "\nclass")
    assert cut_at_stop("abc", ()) == ("abc", None)


def test_adapter_records_token_counts(tiny_model):
    adapter = HFAdapter(tiny_model, "bf16", batch_size=2)
    gens = adapter.generate([Request(doc_id=0, prompt=PROMPTS[0], stop=(), max_new_tokens=7)])
    assert gens[0].n_tokens == 7 and gens[0].finish_reason == "length" and gens[0].n_prompt_tokens > 5
    info = adapter.info()
    assert info["model_type"] == "deepseek_v4" and len(info["fingerprint"]) == 16


def test_bad_model_dirs(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope", "bf16")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_model(tmp_path, "bf16")


def test_numerics_are_canonical_by_default_and_recorded(tiny_model):
    from evalgate.model_adapters.canonical.invariant import numerics

    adapter = HFAdapter(tiny_model, "w4a4_packed", batch_size=2)
    assert adapter.info()["numerics"] == "canonical-v1"
    native, _ = load_model(tiny_model, "w4a4_packed", numerics="native")
    assert numerics(native) == "native" and native.config._attn_implementation != "evalgate_canonical"
    with pytest.raises(UserError, match="numerics"):
        load_model(tiny_model, "bf16", numerics="fast")



def test_a_small_checkpoint_is_fingerprinted_by_its_weight_values(tmp_path):
    """A retrained canary has the same shapes: its fingerprint must still differ, or a baseline recorded for
    the old weights would be compared with the new ones."""
    import shutil

    from evalgate.canary import canary_path
    from evalgate.model_adapters.hf.fingerprint import model_fingerprint

    copy = tmp_path / "canary"
    shutil.copytree(canary_path(), copy)
    before = model_fingerprint(copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 0x01  # one weight bit, past the header
    (copy / "model.safetensors").write_bytes(bytes(data))
    after = model_fingerprint(copy)
    assert before["weights_hashed"] == after["weights_hashed"] == "bytes"
    assert after["fingerprint"] != before["fingerprint"]
    assert model_fingerprint(canary_path())["fingerprint"] == before["fingerprint"]  # a copy is the same model
