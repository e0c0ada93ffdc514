"""The Megatron-Core backend (TP/PP/DP): the backend itself, the HF <-> Megatron name and shard
maps, the GPTModel build, the output head (log-probs from the hidden states), packed
micro-batches, weight gather/export and checkpoints, the process groups, and the CPU (gloo)
compatibility shim. Imported only when trainer=megatron is chosen.
"""
