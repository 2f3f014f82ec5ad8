"""meshtrain: train Llama-style language models on one typed config, from a laptop CPU to a cluster."""

__version__ = "0.1.0"
