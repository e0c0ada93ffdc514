"""End to end: async vs sync vs colocated runs of `launch.local`, interleaved."""
