"""The replica: one process per device serving `generate.v2.TextGenerationService` (see README.md)."""
