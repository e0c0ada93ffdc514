"""Data: the built-in arithmetic task, its tokenizer and tiny model, JSONL datasets
(GSM8K, MATH-style, code), and the deterministic prompt stream with a resumable position.
"""
