"""The replica's gRPC edge: the RPC table, the call schema, the core's table, both placements."""
