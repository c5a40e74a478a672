"""Model math, weight layout and loading for Llama-family checkpoints (see README.md)."""
