"""`pdcluster bench serving`: the benchmark, its load generator (workload, client) and its statistics."""
