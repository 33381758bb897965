"""moe-batch: offline high-throughput batch inference for Mixture-of-Experts LLMs."""

__version__ = "0.1.0"

# Heavy modules (torch, transformers) load on first use so `import moe_engine` stays cheap.
_LAZY = {
    "LLMEngine": "moe_engine.engine.llm_engine",
    "EngineStats": "moe_engine.engine.stats",
    "SamplingParams": "moe_engine.engine.request",
    "Request": "moe_engine.engine.request",
    "RequestResult": "moe_engine.engine.request",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_engine' has no attribute {name!r}")
