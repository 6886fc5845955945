"""`python -m custody.cli`: the command without its installed script (the tests use it)."""

import sys

from custody.cli import main

sys.exit(main())
