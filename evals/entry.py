"""How an eval runs as a command: a user's mistake (a model not pulled, an unknown name,
a bad file: a UserError) is one line and exit 2, as `skippy` says it; anything else is
ours and keeps its traceback (SKIPPY_DEBUG=1 keeps it for both)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from skippy.topology.errors import UserError

T = TypeVar("T")


def guarded(main: Callable[..., T], *args) -> T:
    """main(*args), a UserError said in one line (then exit 2)."""
    try:
        return main(*args)
    except UserError as e:
        if os.environ.get("SKIPPY_DEBUG"):
            raise
        print(f"{Path(sys.argv[0]).stem}: error: {e}", file=sys.stderr)
        sys.exit(2)
