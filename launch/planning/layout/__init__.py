"""Where things go: the allocation plan, GPU placement, the rollout fraction, small-cluster
advice and the overrides that make a refused layout work. Pure.
"""
