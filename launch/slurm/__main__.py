"""`python -m launch.slurm status|cancel <job id>` (`make status` / `make cancel`): no venv needed."""

import sys

from launch.slurm.cli import main

sys.exit(main())
