"""Trainer: batch assembly, advantages, the decoupled PPO loss, the backends (plain torch with a
Hugging Face model class; Megatron-Core with TP/PP/DP), the ranks' command channel and rank 0's
weight-update handshake with the controller. Pure maths modules here import no GPU stack.
"""
