"""`python -m launch.submit [KEY=VALUE ...]`: render one heterogeneous SLURM job and submit it
(`make submit`, `make render`).

Hydra's entry point sits here, in the module run as __main__, so that `config_path` is this
file's neighbour `conf/`; the work is launch/slurm/submit.py's.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from areal_jobs.config import register_configs
from launch.slurm import submit


@hydra.main(version_base="1.3", config_path="../conf", config_name="submit")
def main(cfg: DictConfig) -> None:
    submit.main(cfg)


if __name__ == "__main__":
    register_configs()
    # before Hydra: its answer to `cluster.nodse=64` suggests `+cluster.nodse=64`, which it accepts
    submit.refuse_unknown_overrides(sys.argv[1:], Path(__file__).resolve().parents[1] / "conf")
    main()
