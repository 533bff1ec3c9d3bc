"""`kvlm export-hf`: export a checkpoint as a Hugging Face transformers folder."""

from kvlm.interop.hf import add_arguments, main

__all__ = ["add_arguments", "main"]
