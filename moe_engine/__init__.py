"""moe-batch: offline high-throughput batch inference for Mixture-of-Experts LLMs."""

__version__ = "0.1.0"
