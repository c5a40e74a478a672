"""The replica's gRPC edge: servicer, pb<->dataclass conversion, error interceptor, process main."""
