import os
import sys

from core.train.trainer import main

code = main()
# Every file of the run is written and closed: skip the interpreter's slow teardown, so that the run's lock (held
# until this process is gone) is released the moment training is over.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
