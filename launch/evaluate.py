"""`python -m launch.evaluate`: serve a checkpoint and score it (`make eval`) (launch.evaluate)."""

import sys

from launch.evaluation.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
