"""Weights: bucketing of named tensors, the broadcast group between a trainer stage's sender and
every rollout server rank (NCCL on GPUs, gloo on CPU), and each trainer rank's part in it.
"""
