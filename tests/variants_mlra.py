"""GLA-2/4 and MLRA-2/4 through the attention contract (tiny_config: d_model=64, n_head=4, head_dim=16,
kv_lora_rank 64 = 4 blocks of 16, rope_head_dim 8)."""

VARIANTS = [
    ("gla-2", {}),
    ("gla-2", {"q_lora_rank": 32, "latent_scaling": True}),
    ("gla-2", {"rope": False, "gated": True}),
    ("gla-4", {"q_lora_rank": 32, "latent_scaling": True, "kv_lora_rank": 32}),
    ("gla-4", {"arch": "gpt2", "bias": True}),
    ("mlra-4", {}),
    ("mlra-4", {"q_lora_rank": 32, "latent_scaling": True, "attn_out_scaling": True}),
    ("mlra-4", {"rope_head_dim": 0, "gated": True}),
    ("mlra-4", {"latent_norm": False, "kv_lora_rank": 32, "rope_head_dim": 4}),
    ("mlra-2", {}),
    ("mlra-2", {"q_lora_rank": 32, "latent_scaling": True, "attn_out_scaling": True, "gated": True}),
    ("mlra-2", {"rope": False, "arch": "gpt2", "bias": True}),
]
