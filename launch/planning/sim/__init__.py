"""Cluster simulator: a discrete-event model of rollout servers and trainers that drives the
project's own staleness admission (`StalenessManager`), freshness rule (`split_fresh`) and
DP batch balancing (`balanced_microbatches`). Profiles (the inputs) live in conf/sim/.
Pure: no I/O except `profile.load_profile`; CLIs are launch.simulate and launch.planning.layout.allocation.
"""
