"""Transport: typed, versioned messages and their codec, the ZeroMQ channels between the rollout
controller and trainer rank 0, and service discovery through the run directory (who listens where,
free ports). No pickle crosses a process boundary.
"""
