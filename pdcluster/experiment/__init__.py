"""The experiment harness: one file → a matrix of cells run on local clusters or OpenAI servers → a report."""
