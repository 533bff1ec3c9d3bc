"""`kvlm train`: train a model from a preset or YAML config."""

from kvlm.training.train import add_arguments, main

__all__ = ["add_arguments", "main"]
