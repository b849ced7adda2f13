"""Two kinds of failure, told apart at every entry point (issue 48): a mistake in the input
(`UsageError`, raised where the project checks it) is one line and exit status 2; anything
else -- JAX's errors, a bug of ours, a plain ValueError from deep in the build -- exits 1 with
its traceback and a line saying it is not the input's fault. Each case injects the error at
the point where the entry point hands its request to the library."""

from __future__ import annotations

import _entry
import pytest

from nnx_zoo.errors import INTERNAL_ERROR_LINE, UsageError

# module -> (the attribute the entry point calls with its request, a command line that gets
# there); the attribute is looked up when called, so replacing it injects the failure.
ENTRY_POINTS = {
    "train_main": ("nnx_zoo.launch.session.prepare", ["--config=tiny", "--workdir={tmp}/run"]),
    "eval_main": ("nnx_zoo.evaluation.run.evaluate", ["--workdir={tmp}"]),
    "export_main": (
        "nnx_zoo.export.export_run",
        ["--workdir={tmp}", "--format=hf", "--out={tmp}/out"],
    ),
    "plan_main": ("nnx_zoo.planning.cli.plan", ["--config=tiny", "--topology=cpu:8"]),
    "data_main": (
        "nnx_zoo.data.tokenize_corpus.tokenize_corpus",
        ["--source={tmp}/a.txt", "--out={tmp}/store", "--tokenizer=byte"],
    ),
    "serve_main": ("nnx_zoo.serving.load.build", ["--workdir={tmp}", "--port=0"]),
}


def _run(module, monkeypatch, tmp_path, error):
    target, args = ENTRY_POINTS[module]

    def fail(*_, **__):
        raise error

    monkeypatch.setattr(target, fail)
    return _entry.run_main(module, [a.format(tmp=tmp_path) for a in args])


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_an_internal_value_error_exits_1_with_its_traceback(module, monkeypatch, tmp_path):
    result = _run(module, monkeypatch, tmp_path, ValueError("injected internal failure"))
    assert result.returncode == 1, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert "ValueError: injected internal failure" in result.stderr
    assert result.stderr.rstrip().endswith(INTERNAL_ERROR_LINE)


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_a_usage_error_exits_2_in_one_line(module, monkeypatch, tmp_path):
    result = _run(module, monkeypatch, tmp_path, UsageError("injected bad input; valid: x"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["error: injected bad input; valid: x"]


def test_a_run_refused_at_start_leaves_no_checkpoint_folder(tmp_path):
    # The data source is read after the workdir is checked and locked.
    workdir = tmp_path / "run"
    result = _entry.train(
        ["--config=tiny", f"--workdir={workdir}", f"--config.data.source={tmp_path}/missing.txt"]
    )
    assert result.returncode == 2, result.stderr
    assert "missing.txt" in result.stderr
    assert not (workdir / "checkpoints").exists()


def test_a_parquet_file_without_the_text_column_names_the_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nnx_zoo.data import sources

    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "a.parquet")
    with pytest.raises(UsageError, match=r"no column 'text' \(columns: \['body'\]\); set data"):
        sources.load_documents(str(tmp_path / "a.parquet"), "all")
