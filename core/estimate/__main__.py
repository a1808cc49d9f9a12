import sys

from core.estimate.cli import main

if __name__ == "__main__":
    sys.exit(main())
