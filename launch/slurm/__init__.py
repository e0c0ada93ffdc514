"""The cluster: rendering the heterogeneous sbatch script (`render.py`), submission (`submit.py`),
the one seam to sbatch/squeue/scancel (`cli.py`, standard library only, so `python -m launch.slurm
status|cancel` needs no venv), satellite jobs of rollout servers (`satellites.py`), auxiliary
evaluation jobs (`aux_jobs.py`) and the committed reference renders (`golden.py`).
"""
