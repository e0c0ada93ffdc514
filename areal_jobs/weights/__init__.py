"""Weights: bucketing of named tensors, the broadcast group between a trainer stage's sender and
every rollout server rank (NCCL on GPUs, gloo on CPU), and each trainer rank's part in it; the
delta codec, the sender's last shipped copy and a server rank's receiver (weight_sync.sync=delta,
docs/weight-sync.md), and the phases of one update (`weights/*` metrics).
"""
