import sys

from core.estimate.bill import main

sys.exit(main())
