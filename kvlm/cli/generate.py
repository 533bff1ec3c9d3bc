"""`kvlm generate`: stream text from a checkpoint."""

from kvlm.inference.generation import add_arguments, main

__all__ = ["add_arguments", "main"]
