"""Data: the built-in arithmetic task, its tokenizer and tiny model, JSONL datasets
(GSM8K, MATH-style, code), the deterministic prompt stream with a resumable position, the
staleness bound both roles apply, and sequence packing into balanced micro-batches.
"""
