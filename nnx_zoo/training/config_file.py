"""One line for a `--config=FILE` that did not load, whatever went wrong in it.

A config file is Python: a module defining `get_config()` that returns an ml_collections
ConfigDict (configs/*.py). ml_collections' config_flags imports the file while parsing the
flags, so any error in it (a syntax error, an exception raised by `get_config`, a JSON or
YAML file given instead) arrives there with a multi-line message or a stack trace; the entry
points turn each into one line naming the file and what a config file must be.
"""

from __future__ import annotations

import os
import re

EXPECTED = "a Python file defining get_config() that returns a ConfigDict, like configs/tiny.py"


def load_error_message(error: BaseException, path: str) -> str:
    """`--config=PATH: cannot load the config file: <why>; <what it must be>`."""
    head = f"--config={path}: cannot load the config file"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errno_line = re.search(r"\[Errno \d+\][^\n]*", str(error))
    if errno_line:
        return f"{head}: {errno_line.group(0).strip()}"
    if not path.endswith(".py") and os.path.isfile(path):
        return f"{head}: not a Python file; a config file is {EXPECTED}"
    if isinstance(error, SyntaxError):
        where = f" at line {error.lineno}" if error.lineno else ""
        return f"{head}: Python syntax error{where} ({error.msg}); a config file is {EXPECTED}"
    if isinstance(error, AttributeError) and "get_config" in str(error):
        return f"{head}: it defines no get_config(); a config file is {EXPECTED}"
    reason = lines[-1] if lines else ""
    return f"{head}: {type(error).__name__}{': ' + reason if reason else ''}"
