"""The trainer measured: tokens/s by backend, memory per micro-batch beside the planner,
activation and log-prob memory, packing, and the one-GPU bench (`make bench-gpu`).
"""
