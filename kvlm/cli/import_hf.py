"""`kvlm import-hf`: import a Llama checkpoint, optionally converting it to MLA."""

from kvlm.interop.convert import add_arguments, main

__all__ = ["add_arguments", "main"]
