"""The KV page allocator: pure Python, no torch, no grpc (see README.md)."""
