"""A tiny random DeepSeek-V4 checkpoint with a real tokenizer, for tests and for trying evalgate out.

The configuration follows the DSV4-Flash layout scaled down: hyper-connections, hash-routed first layer,
sqrt-softplus routing with bias, a shared expert, fused 3D experts, top-6 of many experts, hidden and
intermediate sizes multiples of 32 (the FP4/FP8 group size). Attention layers are ``sliding_attention``
with a window wider than any sequence evalgate feeds it: transformers 5.23's compressed-attention layers
decode differently with and without the KV cache (logits drift by up to ~0.1), sliding-window layers this
wide match a full forward pass to ~5e-5.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def build_tokenizer(texts: list[str], vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on ``texts`` (seconds on a CPU), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def tiny_config(vocab_size: int, **overrides):
    from transformers import DeepseekV4Config

    n_layers = overrides.pop("num_hidden_layers", 2)
    cfg = dict(
        vocab_size=vocab_size, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        n_routed_experts=16, num_experts_per_tok=6, n_shared_experts=1,
        layer_types=["sliding_attention"] * n_layers,
        mlp_layer_types=["hash_moe"] + ["moe"] * (n_layers - 1),
        sliding_window=8192, max_position_embeddings=8192, o_groups=2, o_lora_rank=32,
        index_n_heads=2, index_head_dim=16, hc_mult=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg.update(overrides)
    return DeepseekV4Config(**cfg)


# sliding window, CSA and HCA layers at sizes where a GSM8K prompt crosses the window and closes compressor
# windows of both kinds
COMPRESSED = dict(num_hidden_layers=3, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                    "heavily_compressed_attention"],
                  mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=32,
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}, index_topk=8)


def build_tiny_model(out_dir: str | Path, texts: list[str], seed: int = 0, vocab_size: int = 1024,
                     dtype: torch.dtype = torch.bfloat16, **config_overrides) -> Path:
    """Write a random tiny DeepSeek-V4 checkpoint (config, safetensors, tokenizer) to ``out_dir``."""
    from transformers import DeepseekV4ForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer(texts, vocab_size)
    config = tiny_config(len(tokenizer), **config_overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    fill_hash_routes(model, seed)
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def fill_hash_routes(model, seed: int) -> None:
    """A freshly initialised ``tid2eid`` is all zeros (every token to expert 0, six times); give each token
    six distinct experts, as a real hash layer has."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "tid2eid"):
            vocab, k = module.tid2eid.shape
            routes = torch.stack([torch.randperm(module.num_experts, generator=g)[:k] for _ in range(vocab)])
            module.tid2eid.copy_(routes)


def main(argv: list[str] | None = None) -> None:
    """``python -m evalgate.model_adapters.hf.tiny OUT_DIR``: a random tiny checkpoint to try evalgate on."""
    import argparse
    import json

    from evalgate.tasks.data import parse_jsonl, read_verified, resolve_data_dir
    from evalgate.tasks.gsm8k import FILES

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--data-dir", default=None, help="tokenizer training text comes from gsm8k/train.jsonl here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compressed", action="store_true",
                        help="one layer of each DeepSeek-V4 attention kind (COMPRESSED), not sliding windows only")
    args = parser.parse_args(argv)
    data_dir = resolve_data_dir(args.data_dir)
    rows = parse_jsonl(read_verified(data_dir, FILES["train"]))[:2000]
    path = build_tiny_model(args.out_dir, [r["question"] + "\n" + r["answer"] for r in rows], seed=args.seed,
                            **(COMPRESSED if args.compressed else {}))
    print(json.dumps({"model": str(path)}))


if __name__ == "__main__":
    main()
