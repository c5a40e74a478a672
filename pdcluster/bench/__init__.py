"""The benchmarks behind `pdcluster bench ...` and the serving load generator."""
