"""tserve: an OpenAI-compatible LLM inference server on structured concurrency."""

from tserve.protocol import FinishReason, SamplingParams

__all__ = ["FinishReason", "SamplingParams", "__version__"]

__version__ = "0.1.0"
