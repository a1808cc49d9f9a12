"""`python -m lora_cockpit`: the same as the `lora-cockpit` command."""

import sys

from lora_cockpit.cli import main

if __name__ == "__main__":
    sys.exit(main())
