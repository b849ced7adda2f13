"""bench/gpu_session.py, the script a GPU session runs as-is: its dry run lists every stage's
commands, and each command's flags are ones its own script accepts (bench scripts: their
argument parsers; train_main: fields of the config it names), so the script cannot rot
between GPU sessions. Running the stages needs the GPU; their parts run tiny elsewhere
(tests/test_vs_torch_gpu.py, tests/test_profile.py)."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex

import pytest

from bench import gpu_session


def _dry_run(stages: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gpu_session.main(["--dry-run", "--out=/tmp/x", f"--stages={stages}"])
    return out.getvalue().splitlines()


def test_every_command_parses():
    lines = _dry_run(",".join(gpu_session.stages("/tmp/x")))
    assert sum(line.startswith("# ") for line in lines) == len(gpu_session.stages("/tmp/x"))
    checked = 0
    for line in lines:
        if line.startswith("#"):
            continue
        # Environment assignments (XLA_FLAGS=...) lead; the command follows.
        words = [w for w in shlex.split(line) if not re.match(r"^[A-Z_]+=", w)]
        if "-m" in words:
            module = words[words.index("-m") + 1]
            args = words[words.index("-m") + 2 :]
            parse = getattr(importlib.import_module(module), "parse_args", None)
            if parse is not None:
                parse(args)  # argparse exits 2 on an unknown flag
                checked += 1
        else:
            assert words[1] == "train_main.py"
            config = importlib.import_module("configs.llama3_1b").get_config()
            for word in words[2:]:
                if word.startswith("--config."):
                    section, field = word.split("=")[0].removeprefix("--config.").split(".")
                    assert field in config[section], word
            checked += 1
    assert checked >= 10


def test_unknown_stage_is_refused():
    with pytest.raises(SystemExit, match="unknown nope"):
        _dry_run("table,nope")
