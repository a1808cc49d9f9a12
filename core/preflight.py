"""`python -m core.preflight`: the documented command; the code lives in core.train.preflight."""

import sys

from core.fmt import run_piped
from core.train.preflight import main

if __name__ == "__main__":
    sys.exit(run_piped(main))
