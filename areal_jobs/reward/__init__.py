"""Reward: math verifiers, the code sandbox, and the process-pool service the controller awaits.
Reward functions are pure and registered by name; the sandbox runs untrusted programs.
"""
