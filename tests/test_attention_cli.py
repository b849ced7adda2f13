"""An attention backend named on the command line that cannot run on this host is one line
on stderr and exit status 2, before anything compiles (this host is a CPU)."""

from __future__ import annotations

import pytest
from _train_helpers import run_train_main

CASES = {
    "splash flag": (["--attention_impl=splash"], "'splash' needs a TPU"),
    "cudnn config field": (["--config.model.attention_impl=cudnn"], "'cudnn' needs an NVIDIA GPU"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_backend_that_cannot_run_here_exits_2_with_one_line(case, tmp_path):
    args, expected = CASES[case]
    result = run_train_main([f"--workdir={tmp_path}", *args])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: attention implementation") and expected in lines[0]
    assert "use 'xla' or 'auto'" in lines[0]
