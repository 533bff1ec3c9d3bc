"""`kvlm bench`: prefill / decode latency, throughput, memory, against peers and the roofline."""

from kvlm.bench.run import add_arguments, main

__all__ = ["add_arguments", "main"]
