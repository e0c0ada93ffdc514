"""A job on this machine: the local launcher (`local.py`), the elastic server pool (`elastic.py`),
growing or shrinking a running job's pool (`scale.py`, local and SLURM), and the online
re-planner that runs beside a job (`replanner.py`, also inside SLURM jobs).
"""
