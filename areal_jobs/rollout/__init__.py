"""Rollout: the asyncio controller (admission under the staleness bound, interruption and
continuation, rewards, pushing trajectories) and the launch/client code for SGLang servers.
The controller is the single owner of rollout state.
"""
