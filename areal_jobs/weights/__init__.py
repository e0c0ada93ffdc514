"""Weights: bucketing of named tensors, the broadcast group between trainer rank 0 and every
rollout server rank (NCCL on GPUs, gloo on CPU), and the safetensors disk fallback.
"""
