import sys

from core.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
