"""The ranks: the command channel between them, process groups, each rank's GPU share and
the bytes it holds (parameters and optimiser state).
"""
