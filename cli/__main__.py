"""``python -m cli``: the ``judge`` command line."""

import sys

from cli.main import main

sys.exit(main())
