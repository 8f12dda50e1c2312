"""`python -m qerl ...`: see qerl/cli.py."""

import sys

from qerl.cli import main

try:
    code = main()
except KeyboardInterrupt:  # Ctrl-C before the command started (argument parsing, imports)
    code = 130
sys.exit(code)
