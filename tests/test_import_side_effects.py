"""Importing the project changes nothing process-wide (issue 48, item 3): a notebook that
imports every module of `zoo/`, `shardings/`, `configs/` and `nnx_zoo/` keeps its logging
configuration, its hooks, its environment (XLA_FLAGS included), its warnings filters, its
signal handlers, absl's verbosity and JAX's config as they were.

The libraries the project imports may change such things themselves (absl adds its handler,
for one), which is theirs to answer for: a first process lists every other module that
importing the project loads; a second imports those first, then takes the state, imports the
project, and compares. Both are fresh processes, so nothing a test did before counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _train_helpers import ROOT

PACKAGES = ("zoo", "shardings", "configs", "nnx_zoo")
# The packages of optional extras: a module that needs one that is not installed is left out
# (the test hosts install every extra, so there all of them are imported).
EXTRAS = ("lm_eval", "fastapi", "uvicorn", "openai", "torch", "transformers", "peft", "libtpu")

_IMPORT_OURS = f"""
import importlib, pkgutil, sys

def import_ours():
    skipped = []
    for top in {PACKAGES!r}:
        names = [top] + [
            m.name for m in pkgutil.walk_packages(importlib.import_module(top).__path__, top + ".")
        ]
        for name in names:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] not in {EXTRAS!r}:
                    raise
                skipped.append(name)
    return skipped

def ours(name):
    return name.split(".")[0] in {PACKAGES!r}
"""

LIST_THEIRS = (
    _IMPORT_OURS
    + """
import json
import_ours()
print(json.dumps([n for n in list(sys.modules) if not ours(n) and n != "__main__"]))
"""
)

COMPARE = (
    _IMPORT_OURS
    + r"""
import json, logging, os, signal, threading, warnings

for name in json.loads(sys.argv[1]):
    try:  # in the order the project's import loaded them; a few load only as a submodule
        importlib.import_module(name)
    except Exception:
        pass

def described(obj):
    kind = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', '?')}#{id(obj)}"

def logger_state(logger):
    return {
        "level": logger.level,
        "disabled": logger.disabled,
        "propagate": logger.propagate,
        "filters": [described(f) for f in logger.filters],
        "handlers": [
            [described(h), h.level, [described(f) for f in h.filters], described(h.formatter)]
            for h in logger.handlers
        ],
    }

def state():
    loggers = {"<root>": logging.getLogger()}
    loggers.update(
        (name, logger) for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    )
    found = {
        "loggers": {name: logger_state(logger) for name, logger in loggers.items()},
        "logging.disable": logging.root.manager.disable,
        "hooks": {
            "sys.unraisablehook": described(sys.unraisablehook),
            "sys.excepthook": described(sys.excepthook),
            "sys.displayhook": described(sys.displayhook),
            "threading.excepthook": described(threading.excepthook),
        },
        "environ": dict(os.environ),
        "warnings.filters": [
            [action, getattr(message, "pattern", message), category.__name__,
             getattr(module, "pattern", module), lineno]
            for action, message, category, module, lineno in warnings.filters
        ],
        "signals": {
            s.name: described(signal.getsignal(s))
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
        },
    }
    if "absl.logging" in sys.modules:
        found["absl verbosity"] = sys.modules["absl.logging"].get_verbosity()
    if "jax" in sys.modules:
        found["jax.config"] = {k: repr(v) for k, v in sys.modules["jax"].config.values.items()}
    return found

before = state()
skipped = import_ours()
after = state()
# A logger first made by the import (`logging.getLogger(__name__)`) is new, not a change,
# as long as it is as logging makes one.
fresh = {"level": 0, "disabled": False, "propagate": True, "filters": [], "handlers": []}
changes = []
for key in after:
    if key == "loggers":
        for name, now in after[key].items():
            was = before[key].get(name, fresh)
            if now != was:
                changes.append([f"logger {name!r}", was, now])
    elif key == "environ":
        for name in sorted(set(before[key]) | set(after[key])):
            if before[key].get(name) != after[key].get(name):
                changes.append([f"environ {name}", before[key].get(name), after[key].get(name)])
    elif after[key] != before.get(key):
        changes.append([key, before.get(key), after[key]])
print(json.dumps({"changes": changes, "skipped": skipped}))
"""
)


def _python(code: str, *args: str) -> str:
    # The environment of a user's shell: none of the test session's XLA or JAX settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_every_module_changes_nothing_process_wide():
    theirs = _python(LIST_THEIRS)
    result = json.loads(_python(COMPARE, theirs))
    assert result["changes"] == [], json.dumps(result["changes"], indent=1)[:4000]
    # Every extra is installed where the suite runs (.ci/run): nothing was left out.
    assert result["skipped"] == []
