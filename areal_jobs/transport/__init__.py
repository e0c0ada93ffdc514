"""Transport: typed, versioned messages and their codec, and the ZeroMQ channels between the
rollout controller and trainer rank 0. No pickle crosses a process boundary.
"""
