"""KV migration between replicas: Migrate/Immigrate, the partial halves, and prefill-then-migrate."""
