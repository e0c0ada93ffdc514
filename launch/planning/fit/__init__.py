"""What fits in memory: the trainer's memory per rank, the servers' KV cache, the model's
shape, a shared GPU's division, the reward model's servers. Pure.
"""
