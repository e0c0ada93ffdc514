"""`python -m launch.local [KEY=VALUE ...]`: the whole job on this machine (`make run`).

Hydra's entry point sits here, in the module run as __main__, so that `config_path` is this
file's neighbour `conf/`; the work is launch/run/local.py's.
"""

import hydra
from omegaconf import DictConfig

from launch.run import local


@hydra.main(config_path="../conf", config_name="local", version_base=None)
def main(dcfg: DictConfig) -> None:
    local.main(dcfg)


if __name__ == "__main__":
    main()
