"""The PyTorch FSDP2 backend: a Hugging Face model sharded over data-parallel ranks, and its
sharded checkpoint state. Imported only when trainer=fsdp is chosen.
"""
