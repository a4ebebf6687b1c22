"""Files that hold a secret (API keys, the cluster secret): read only where nobody but
their owner can read them, as ssh reads a private key. Whoever else can read such a file
holds what it guards: a key file left 0644 on a shared head is everyone's key."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from skippy.topology.errors import UserError


def read_private(path: str | Path, what: str, error: type[UserError]) -> str:
    """The text of the file at `path` (`what` names it in messages: "the API key file");
    `error` (one line) where it cannot be read, or where it is a regular file that its
    group or others may open (a pipe or a device, `<(pass show key)`, is the caller's)."""
    try:
        with open(path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                raise error(f"{what} {path} is open to other users (mode "
                            f"{stat.S_IMODE(st.st_mode):o}): chmod 600 {path}")
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise error(f"cannot read {what} {path}: {reason}") from None
