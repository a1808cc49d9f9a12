import sys

from core.demo.build import main

sys.exit(main())
