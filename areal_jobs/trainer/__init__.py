"""Trainer: the step at the top (`loop.py`, `session.py`, `main.py`), its stages in rooms --
intake/ (batch in), forward/ (log-probs), objective/ (loss), publish/ (weights out), dist/ (the
ranks) -- and the backends in theirs: torch/ (the default), megatron/, fsdp/. The optimiser
step is each backend's. `backends.py` is the one seam that names them. Pure maths modules import
no GPU stack.
"""
