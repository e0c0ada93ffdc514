"""Planning, pure functions of the config: the allocation plan (`plan.py`) and GPU placement
(`placement.py`), the simulator (`sim/`) and what is decided with it: the rollout fraction
(`allocation.py`), small-cluster advice, re-planning (`replan.py`), autoscale decisions, and the
fault and scaling reports (`fault_report.py`, `simulate.py`).
"""
