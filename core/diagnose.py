"""`python -m core.diagnose`: the documented command; the code lives in core.monitor.diagnose."""

import sys

from core.monitor.diagnose import main

if __name__ == "__main__":
    sys.exit(main())
