"""Trainer: the backend-independent core (batch assembly, advantages, the decoupled PPO loss, the
chunked LM head's log-probs and entropy, the train loop, the ranks' command channel and rank 0's
weight-update handshake), the plain-torch backend (`torch_backend.py`) and the seam that picks a
backend (`backends.py`). The multi-rank backends have their own packages: `megatron/`
(Megatron-Core TP/PP/DP) and `fsdp/` (FSDP2). Pure maths modules here import no GPU stack.
"""
