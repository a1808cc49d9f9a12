import sys

from core.eval.cli import main
from core.fmt import run_piped

if __name__ == "__main__":
    sys.exit(run_piped(main))
