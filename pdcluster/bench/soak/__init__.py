"""`pdcluster bench soak`: a local cluster under mixed traffic, admin churn and replica kills, with its
processes' resources sampled and judged for unbounded growth (bench.py)."""
