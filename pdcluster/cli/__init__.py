"""The `pdcluster` command: `main` is the console script."""

from pdcluster.cli.main import main

__all__ = ["main"]
