"""Hugging Face ``transformers`` causal LMs as a model family (imported lazily: nothing here
imports ``transformers`` until a model of it is found or built)."""
