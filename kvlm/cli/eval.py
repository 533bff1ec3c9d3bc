"""`kvlm eval`: perplexity, repetition and lm-eval tasks for a checkpoint."""

from kvlm.inference.evaluation import add_arguments, main

__all__ = ["add_arguments", "main"]
