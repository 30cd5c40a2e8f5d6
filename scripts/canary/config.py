"""The canary's architecture: transformers' ``deepseek_v4`` scaled down, every DSV4-Flash feature kept.

- hyper-connections (``hc_mult`` 2 instead of 4: the same mechanism, half the CPU cost);
- a hash-routed first layer (``tid2eid``), then sqrt-softplus routed layers with the selection bias;
- one shared expert, fused 3D routed experts, 32 experts with top-6 routing, ``routed_scaling_factor``
  1.5, ``swiglu_limit`` 10;
- hidden 256 and expert intermediate 128: multiples of 32, the FP4/FP8 group size, so every quantized
  operand has whole groups (8 groups per token in L1, 4 in the intermediate);
- ``sliding_attention`` layers with a window of 2048, wider than any canary sequence (at most ~700
  tokens): transformers 5.23's compressed-attention layers decode differently with and without the KV
  cache (logits drift by up to ~0.1), while these match a full forward pass (tests/test_canary.py).
"""

from __future__ import annotations

N_LAYERS = 3
ARCH = dict(
    hidden_size=256, moe_intermediate_size=128, num_hidden_layers=N_LAYERS,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=128,
    n_routed_experts=32, num_experts_per_tok=6, n_shared_experts=1,
    layer_types=["sliding_attention"] * N_LAYERS, mlp_layer_types=["hash_moe"] + ["moe"] * (N_LAYERS - 1),
    sliding_window=2048, max_position_embeddings=2048, o_groups=2, o_lora_rank=128,
    index_n_heads=2, index_head_dim=32, hc_mult=2, swiglu_limit=10.0, routed_scaling_factor=1.5,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def canary_config(vocab_size: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=vocab_size, **ARCH)
