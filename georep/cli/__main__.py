"""``python -m georep.cli``: the ``georep`` command (how nodes record their own command line)."""

import sys

from georep.cli.main import main

sys.exit(main())
