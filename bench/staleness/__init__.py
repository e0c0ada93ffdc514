"""Where staleness bites: the eta ablation (naive vs decoupled PPO at exact delays), its
tables and probe, and the cost of the off-policy corrections. Results in results/.
"""
