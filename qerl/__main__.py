"""`python -m qerl ...`: see qerl/cli.py."""

import sys

from qerl.cli import main

sys.exit(main())
