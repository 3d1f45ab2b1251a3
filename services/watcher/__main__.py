"""Entry point: `python -m services.watcher`."""

import sys

from services.watcher.service import main

if __name__ == "__main__":
    sys.exit(main())
