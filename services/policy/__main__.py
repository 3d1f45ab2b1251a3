"""Entry point: `python -m services.policy`."""

import sys

from services.policy.service import main

if __name__ == "__main__":
    sys.exit(main())
