"""`python -m kvlm.cli` (what `torchrun ... -m kvlm.cli VERB` runs)."""

import sys

from kvlm.cli import main

sys.exit(main())
