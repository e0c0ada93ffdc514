"""Batch in: the inbox of trajectories, the train batch, its broadcast to the ranks, packing
and balanced micro-batches, data-parallel plans.
"""
