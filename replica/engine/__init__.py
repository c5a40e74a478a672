"""The engine: batches, the forward loop, sampling, stopping, detokenization (see README.md)."""
