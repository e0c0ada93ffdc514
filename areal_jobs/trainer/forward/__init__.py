"""Log-probs: the chunked LM head and its kernels, a Hugging Face model's packed forward,
attention over packed sequences, compiled layers, LoRA adapters.
"""
