"""Trainer: batch assembly, advantages, the decoupled PPO loss, packing, and the two backends
(plain torch with a Hugging Face model class; Megatron-Core with TP/PP/DP).
Pure maths modules here import no GPU stack; backend modules stay thin.
"""
