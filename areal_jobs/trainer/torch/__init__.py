"""The default backend (`trainer=torch`): one process, plain PyTorch, in `backend.py`."""
