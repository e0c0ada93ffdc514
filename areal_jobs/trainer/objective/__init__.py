"""The loss: advantages, the decoupled PPO objective and its statistics, the pre-clip watch."""
