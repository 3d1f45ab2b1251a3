"""Entry point: `python -m services.ipam`."""

import sys

from services.ipam.service import main

if __name__ == "__main__":
    sys.exit(main())
