"""The RDMA fabric (pyverbs RC queue pairs); pyverbs is imported only when this fabric is created."""
