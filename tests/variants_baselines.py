"""GTA, MFA and TPA through the attention contract (tiny_config: d_model=64, n_head=4, head_dim=16)."""

VARIANTS = [
    ("gta", {}),  # g = n_head // 4 = 1, rope_head_dim 8
    ("gta", {"n_kv_head": 2, "gated": True}),
    ("gta", {"n_kv_head": 2, "rope": False}),  # K = V entirely
    ("gta", {"rope_head_dim": 16, "arch": "gpt2", "bias": True}),  # no tied NoPE part left
    ("mfa", {"q_lora_rank": 32}),
    ("mfa", {"q_lora_rank": 32, "head_dim": 32, "latent_scaling": True, "gated": True}),  # the paper's 2 d_h
    ("mfa", {"rope": False}),
    ("tpa", {}),  # beta_q 6, beta_kv 2
    ("tpa", {"tpa_q_rank": 3, "tpa_kv_rank": 1, "gated": True}),
    ("tpa", {"rope": False, "arch": "gpt2", "bias": True}),
]
