"""``python -m ppmedia ...`` (also ``torchrun --nproc-per-node 2 -m ppmedia demo``)."""

import sys

from .cli import main

sys.exit(main())
