"""`python -m launch.plan_allocation`: which rollout fraction, and why (launch.plan_allocation)."""

import sys

from launch.planning.layout.allocation import main

if __name__ == "__main__":
    sys.exit(main())
