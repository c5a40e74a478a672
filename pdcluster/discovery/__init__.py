"""Device discovery: what one node has (CUDA devices, NICs, CPU cores), as `pdcluster devices` prints it."""
