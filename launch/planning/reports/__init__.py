"""What the reports say: the simulator's throughput, fault and weight-update reports."""
