"""mashbox: a local LLM inference server speaking the OpenAI and Anthropic APIs."""

__version__ = "0.1.0"
