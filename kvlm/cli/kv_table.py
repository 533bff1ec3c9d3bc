"""`kvlm kv-table`: KV cache and parameter accounting of presets (the papers' tables)."""

from kvlm.accounting import add_arguments, main

__all__ = ["add_arguments", "main"]
