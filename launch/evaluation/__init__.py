"""Evaluating a checkpoint: resolve it (`checkpoint.py`), serve it on a rollout server and score
it (`evaluate.py`), and the report (`report.py`).
"""
