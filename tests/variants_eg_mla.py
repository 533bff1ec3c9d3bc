"""EG-MLA configurations run through the generic contract tests (tests/test_attention_contract.py)."""

VARIANTS = [
    ("eg-mla", {}),  # Listing 1: gate * W^UKV c, LayerNorm, decoupled RoPE
    ("eg-mla", {"eg_norm": False}),  # Table 3: without LayerNorm
    ("eg-mla", {"eg_op": "add"}),  # Table 3: addition instead of the Hadamard product
    ("eg-mla", {"eg_group_size": 2, "n_layer": 4, "kv_emb_dim": 16}),  # Appendix H, lgz = 2
    ("eg-mla", {"kv_emb_dim": 96, "kv_lora_rank": 8, "q_lora_rank": 16}),  # wide table, tiny cache
    ("eg-mla", {"rope": False, "gated": True}),
    ("eg-mla", {"arch": "gpt2", "bias": True, "latent_scaling": True, "q_lora_rank": 24}),
]
