"""`pdcluster bench scaling`: a burst against a small cluster that scales itself, under every policy."""
