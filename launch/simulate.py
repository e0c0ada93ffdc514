"""`python -m launch.simulate`: the discrete-event projection and its reports (launch.simulate)."""

import sys

from launch.planning.reports.simulate import main

if __name__ == "__main__":
    sys.exit(main())
