"""kvdiag: make the KV cache of LLM serving engines observable."""

__version__ = "0.1.0"
