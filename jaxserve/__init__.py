"""jaxserve: an LLM serving engine on JAX/XLA with continuous batching over a paged KV cache.

Importing the package is cheap and does not import jax; the engine loads it when built.
"""

from jaxserve.config import EngineConfig
from jaxserve.core.intake import RequestError
from jaxserve.core.request import FinishReason, SamplingParams
from jaxserve.lora.request import LoRARequest

__all__ = ["LLM", "EngineConfig", "SamplingParams", "FinishReason", "RequestOutput",
           "RequestError", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from jaxserve.entrypoints.llm import LLM
        return LLM
    if name == "RequestOutput":
        from jaxserve.engine.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
