"""`make proto-check`: fail when the committed gRPC stubs differ from what `make proto` generates.

A thin entry point: the check is `pdcluster.tools.proto_check`.
"""

import sys

from pdcluster.tools.proto_check import main

if __name__ == "__main__":
    sys.exit(main())
