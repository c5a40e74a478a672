"""The TCP fabric: one connection per (peer, stream, direction), zero-copy gather/scatter I/O."""
