"""`python -m launch.scale`: grow or shrink a running job's rollout pool (`make scale`) (launch.scale)."""

import sys

from launch.run.scale import main

if __name__ == "__main__":
    sys.exit(main())
