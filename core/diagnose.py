"""`python -m core.diagnose`: the documented command; the code lives in core.monitor.diagnose."""

import sys

from core.fmt import run_piped
from core.monitor.diagnose import main

if __name__ == "__main__":
    sys.exit(run_piped(main))
