"""nnx_zoo/runtime/console.py: what a process prints for its user, from process 0 only, and
a library's error cut to the one line an error message of ours quotes."""

from __future__ import annotations

from nnx_zoo.runtime.console import one_line, say, warn


def test_one_line_is_the_first_line_of_the_message_folded():
    error = RuntimeError("  Parquet magic bytes\tnot found \n  at offset 0\n")
    assert one_line(error) == "Parquet magic bytes not found"
    assert one_line(ValueError("")) == "ValueError"  # no message: the type's name
    assert one_line(OSError("\n\n second line first")) == "second line first"


def test_one_line_cuts_an_embedded_bound_method_repr():
    # tensorstore's errors embed the repr of a pybind11 method after the useful part.
    error = ValueError("DATA_LOSS: checksum mismatch: <bound method Spec.open of <x>>")
    assert one_line(error) == "DATA_LOSS: checksum mismatch"


def test_process_0_says_and_warns_on_stdout_and_stderr(capsys):
    say("resumed from step 3")
    warn("the data differs")
    out, err = capsys.readouterr()
    assert out == "resumed from step 3\n" and err == "warning: the data differs\n"
