"""pdcluster, the product around the core packages (`replica`, `router`, `transfer`, `protos`).

- `pdcluster.cli`: the `pdcluster` command (one subcommand per process or tool) and the demo;
- `pdcluster.cluster`: starting processes: a local cluster (`pdcluster up`), replicas across nodes
  (`pdcluster launch`), a replica subprocess on loopback;
- `pdcluster.bench`: the benchmarks (`pdcluster bench ...`) and the serving load generator;
- `pdcluster.tools`: tiny checkpoints for tests and the demo, the generated-stub check.
"""

from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The folder holding the installed packages (the repository, in an editable install): the working
directory of the processes a local cluster starts, so relative paths mean the same to them."""
