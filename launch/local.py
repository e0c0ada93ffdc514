"""`python -m launch.local [KEY=VALUE ...]`: the whole job on this machine (`make run`).

Hydra's entry point sits here, in the module run as __main__, so that `config_path` is this
file's neighbour `conf/`; the work is launch/run/local.py's.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from launch.run import local


@hydra.main(config_path="../conf", config_name="local", version_base=None)
def main(dcfg: DictConfig) -> None:
    local.main(dcfg)


if __name__ == "__main__":
    # before Hydra: its answer to `cluster.nodse=64` suggests `+cluster.nodse=64`, which it accepts
    local.refuse_unknown_overrides(sys.argv[1:], Path(__file__).resolve().parents[1] / "conf")
    main()
