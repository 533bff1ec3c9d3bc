"""`kvlm prepare`: tokenize text (local files, a HF dataset, or built-in synthetic stories) into shards."""

from kvlm.data.prepare import add_arguments, main

__all__ = ["add_arguments", "main"]
