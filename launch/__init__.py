"""Launch: the commands you type are the modules at this level (`python -m launch.local`, `.submit`,
`.evaluate`, `.simulate`, `.scale`, `.plan_allocation`); each only hands over to its room:

    run/         a job on this machine: the local launcher, the elastic pool, scale, the re-planner
    slurm/       the cluster: sbatch rendering, submission, the sbatch/squeue/scancel seam, satellites
    planning/    allocation planning, placement, the simulator (sim/) and its reports; pure functions
    evaluation/  serving a checkpoint and scoring it

Rooms import downward only: run -> slurm -> planning; evaluation stands alone.
"""
