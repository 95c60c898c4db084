"""``python -m service.cli``: the ``judge`` command line."""

import sys

from service.cli.main import main

sys.exit(main())
