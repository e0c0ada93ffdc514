"""Rewards measured: rewards/s by verifier, sandbox mode, reward model, and their overhead."""
