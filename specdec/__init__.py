"""specdec: a speculative decoding engine (paged KV, tree verification, lossless acceptance)."""

from specdec.outputs import RequestMetrics, RequestOutput
from specdec.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "RequestMetrics"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for
    if name == "LLM":
        from specdec.engine.llm import LLM

        return LLM
    raise AttributeError(name)
