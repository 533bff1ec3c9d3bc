VARIANTS = [
    ("mha", {}),
    ("mqa", {}),
    ("gqa", {"n_kv_head": 2}),
    ("mha", {"rope": False}),
    ("gqa", {"n_kv_head": 2, "gated": True}),
    ("mha", {"arch": "gpt2", "bias": True}),
]
