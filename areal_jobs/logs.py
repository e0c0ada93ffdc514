"""One logger namespace (`areal_jobs.*`), configured only at process entry points.

Library code calls `logging.getLogger(__name__)`. Entry points call `setup_logging(role)`, which
reads the level from AREAL_JOBS_LOG_LEVEL and prefixes every line with the role and rank.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname).1s [{role}] %(name)s: %(message)s"


def setup_logging(role: str, default_level: str = "INFO") -> logging.Logger:
    """Configure the `areal_jobs` logger once for this process and return it."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    tag = f"{role}:{rank}" if rank not in (None, "0") else role
    level = os.environ.get("AREAL_JOBS_LOG_LEVEL", default_level).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(role=tag), datefmt="%H:%M:%S"))
    root = logging.getLogger("areal_jobs")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    for name in ("launch",):
        other = logging.getLogger(name)
        other.handlers[:] = [handler]
        other.setLevel(level)
        other.propagate = False
    # Hydra's logging config (disable_existing_loggers) silences loggers created at import time
    for name, existing in logging.root.manager.loggerDict.items():
        if isinstance(existing, logging.Logger) and name.split(".")[0] in ("areal_jobs", "launch"):
            existing.disabled = False
    return root
