"""``python -m oxibonsai``: the ``oxibonsai`` command."""

import sys

from oxibonsai.cli import main

sys.exit(main())
