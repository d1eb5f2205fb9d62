"""`python -m cli ...` = `specdec ...` (how the launcher and the tests start services)."""

import sys

from cli import main

sys.exit(main())
