"""Adapters for other libraries (Hugging Face, ...)."""
