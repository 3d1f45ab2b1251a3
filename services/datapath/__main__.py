"""Entry point: `python -m services.datapath`."""

import sys

from services.datapath.service import main

if __name__ == "__main__":
    sys.exit(main())
