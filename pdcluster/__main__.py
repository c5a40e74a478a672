"""`python -m pdcluster`: the `pdcluster` command, for subprocesses started with this interpreter."""

import sys

from pdcluster.cli import main

sys.exit(main())
