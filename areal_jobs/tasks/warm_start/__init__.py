"""The builders of the committed models in ../models/: the tiny model and its tokenizer
(`tiny_model`), the countdown and tool-use warm starts, the built-in reward model, and the fact
probe that checks what a warm start knows. Each is `python -m areal_jobs.tasks.warm_start.<name>`.
"""
