"""Planning, pure functions of the config, by question: fit/ (what fits in memory), layout/
(where things go: the plan, placement, the rollout fraction), replanning/ (when to re-plan,
autoscale), reports/ (what the simulator's reports say) and the simulator itself (sim/).
"""

import areal_jobs  # noqa: F401 - installs areal_jobs/moved.py: old module names work for a release
