import sys

from core.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
