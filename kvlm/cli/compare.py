"""`kvlm compare`: train several attention variants and report which is best at what cost."""

from kvlm.compare.run import add_arguments, main

__all__ = ["add_arguments", "main"]
