"""A tiny random DeepSeek-V4 model for tests, `kernels check --shape tiny` and the CPU benchmark.

Hidden and intermediate sizes are multiples of 32 (one UE8M0 group). A randomly initialised hash router's
`tid2eid` is all zeros (every token to expert 0), so it is filled with random experts (spec docs/kernels.md#routing)."""

from __future__ import annotations

import torch


def tiny_config(layers: int = 2, hidden: int = 128, intermediate: int = 64, experts: int = 8, top_k: int = 2,
                vocab: int = 256, hash_layers: int = 1):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=vocab, hidden_size=hidden, moe_intermediate_size=intermediate, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        q_lora_rank=64, o_lora_rank=64, o_groups=2, index_n_heads=2, index_head_dim=32, qk_rope_head_dim=8,
        n_routed_experts=experts, num_experts_per_tok=top_k,
        layer_types=["sliding_attention"] * layers,
        mlp_layer_types=["hash_moe"] * hash_layers + ["moe"] * (layers - hash_layers),
        sliding_window=4096, max_position_embeddings=1024,
    )


def fill_hash_routers(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "tid2eid"):
                n = module.num_experts
                # distinct experts per token: a random permutation's first top_k entries
                perm = torch.argsort(torch.rand(module.tid2eid.shape[0], n, generator=g), dim=-1)
                module.tid2eid.copy_(perm[:, : module.tid2eid.shape[1]])


def tiny_deepseek_v4(seed: int = 0, experts_implementation: str = "bf16", dtype=torch.bfloat16,
                     expert_std: float | None = None, **config_kwargs):
    """A random `DeepseekV4ForCausalLM`. `expert_std` rescales expert weights (default: initializer_range)."""
    from transformers import DeepseekV4ForCausalLM

    import evalgate.kernels.catalogs  # noqa: F401  (registers the kernel names before the model is built)

    config = tiny_config(**config_kwargs)
    config._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    fill_hash_routers(model, seed)
    if expert_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".experts." in name:
                    p.normal_(0.0, expert_std)
    return model.to(dtype)
