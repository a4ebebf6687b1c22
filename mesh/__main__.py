"""`python -m skippy.mesh ARGS` is `skippy ARGS` (the console script's entry point, with
cli imported as skippy.mesh.cli, not run as __main__: its exception types stay one)."""

import sys

from .cli import main

sys.exit(main())
