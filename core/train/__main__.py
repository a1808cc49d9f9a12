import sys

from core.train.trainer import main

sys.exit(main())
