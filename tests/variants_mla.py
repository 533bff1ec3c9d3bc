"""MLA configurations run through the generic contract tests (tests/test_attention_contract.py)."""

VARIANTS = [
    ("mla", {}),  # DeepSeek form: plain W^Q, d_c = 4 d_h, d_h^R = d_h / 2, RMSNorm on the latent
    ("mla", {"q_lora_rank": 32}),  # query compression (Eqs. 37-39)
    (
        "mla",
        {"q_lora_rank": 32, "latent_scaling": True, "kv_lora_rank": 24},
    ),  # alpha_q, alpha_kv (mlra.md 3.3)
    ("mla", {"rope": False}),  # no RoPE at all: no W^QR, W^KR, k_rope
    ("mla", {"rope_head_dim": 16, "latent_norm": False}),
    ("mla", {"kv_latent": "separate", "kv_lora_rank": 32}),  # small-LM form, r = d/2, with RoPE
    ("mla", {"kv_latent": "separate", "kv_lora_rank": 8, "rope": False}),  # r = d/8, no RoPE
    ("mla", {"kv_lora_rank": 8}),  # d_c < d_h: absorbed route folds W^Q.W^UK and W^UV.W^O
    ("mla", {"gated": True, "q_lora_rank": 16}),
    ("mla", {"arch": "gpt2", "bias": True, "kv_lora_rank": 8}),
    ("mla", {"rope_kv_heads": 2}),  # per-group RoPE keys (MHA2MLA), n_head = 4: two heads per k_rope head
    ("mla", {"rope_kv_heads": 4, "kv_lora_rank": 8, "q_lora_rank": 16, "bias": True}),  # one per head, folded
]
