"""Data: what a user's file becomes. JSONL datasets (GSM8K, MATH-style, code), chat templates,
the tokenizer, the deterministic prompt stream with a resumable position, evaluation sets and
the answer-length statistics the simulator reads. The built-in tasks live in areal_jobs/tasks/.
"""
