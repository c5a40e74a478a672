"""Tools around the product: tiny checkpoints (tests, demo) and the generated-stub check."""
