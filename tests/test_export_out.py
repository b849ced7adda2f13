"""export_main never destroys what is at --out (issue 40, item 1), and an HF export of a
byte-tokenizer run carries a tokenizer.json that transformers loads (item 8).

One tiny run (2 steps, byte tokenizer, a checkpoint) is the module fixture; every case
exports it in-process. On 9d09506 the refused cases all exited 0 (or 2 after writing) and
deleted what was there; the byte-tokenizer export had no tokenizer files.
"""

from __future__ import annotations

import json
import os

import _entry
import pytest
from _train_helpers import SMALL_RUN, cli_flags

from nnx_zoo.checkpoint.outputs import MANIFEST

RUN = {**SMALL_RUN, "training.steps": 2, "checkpoint.enabled": True, "checkpoint.every": 2}
RUN |= {"training.eval_every": 0, "optimizer.warmup_steps": 0}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("export_out") / "run")
    result = _entry.train([f"--workdir={path}", *cli_flags(RUN)])
    assert result.returncode == 0, result.stderr[-3000:]
    return path


def _export(workdir: str, out, *flags: str, fmt: str = "hf", cwd: str = _entry.ROOT):
    return _entry.export(
        [f"--workdir={workdir}", f"--format={fmt}", f"--out={out}", *flags], cwd=cwd
    )


def _refused(result, *expected: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _tree(path) -> dict[str, bytes]:
    """Every file under `path` with its bytes: what must survive a refused export."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def test_existing_directory_with_files_is_refused_and_kept(workdir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    _refused(_export(workdir, out), f"--out={out} exists and holds files (notes.txt)")
    assert _tree(out) == {"notes.txt": b"my notes"}
    # --overwrite replaces only an earlier export: these files are not one.
    _refused(_export(workdir, out, "--overwrite"), "that no earlier export_main wrote")
    assert _tree(out) == {"notes.txt": b"my notes"}


@pytest.mark.parametrize("fmt", ["hf", "peft"])
def test_a_file_is_refused_and_kept(workdir, tmp_path, fmt):
    out = tmp_path / "model.bin"
    out.write_bytes(b"weights I keep")
    _refused(_export(workdir, out, fmt=fmt), f"--out={out} is a file, not a directory")
    assert out.read_bytes() == b"weights I keep"
    assert sorted(os.listdir(tmp_path)) == ["model.bin"]  # no NAME.old-XXXX, no staging


def test_out_dot_in_a_working_directory_is_refused(workdir, tmp_path):
    (tmp_path / "train.py").write_text("print('mine')")
    _refused(
        _export(workdir, ".", cwd=str(tmp_path)),
        f"--out={tmp_path} exists and holds files (train.py)",
    )
    assert _tree(tmp_path) == {"train.py": b"print('mine')"}


def test_the_runs_own_workdir_is_refused_even_with_overwrite(workdir):
    before = _tree(workdir)
    for flags in ([], ["--overwrite"]):
        _refused(
            _export(workdir, workdir, *flags),
            f"--out={workdir} is a training run's directory",
            f"--out={os.path.join(workdir, 'hf')}",
        )
    assert _tree(workdir) == before  # checkpoints/, metrics.jsonl, run_info.json untouched


def test_a_path_inside_the_runs_checkpoints_is_refused(workdir):
    out = os.path.join(workdir, "checkpoints", "hf")
    _refused(_export(workdir, out), f"lies inside the training run {workdir}, in its checkpoints")
    assert not os.path.exists(out)


def test_export_overwrite_replaces_only_its_own_output(workdir, tmp_path):
    """A new folder inside the workdir is fine; a second export there needs --overwrite,
    which replaces it whole; a file the user added makes --overwrite refuse."""
    out = os.path.join(workdir, "hf")
    try:
        first = _export(workdir, out)
        assert first.returncode == 0, first.stderr[-3000:]
        with open(os.path.join(out, MANIFEST)) as f:
            manifest = json.load(f)
        assert manifest["written_by"] == "export_main" and manifest["step"] == 2
        assert set(manifest["files"]) == set(os.listdir(out)) - {MANIFEST}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])

        _refused(_export(workdir, out), "holds an earlier export_main output", "--overwrite")
        again = _export(workdir, out, "--overwrite")
        assert again.returncode == 0, again.stderr[-3000:]
        assert sorted(os.listdir(os.path.dirname(out))) == sorted(
            os.listdir(workdir)
        )  # nothing left beside it (no staging or replaced copy)
        assert not [n for n in os.listdir(workdir) if n.startswith(".hf.")]

        with open(os.path.join(out, "README.md"), "w") as f:
            f.write("my model card")
        _refused(_export(workdir, out, "--overwrite"), "did not write (README.md)")
        with open(os.path.join(out, "README.md")) as f:
            assert f.read() == "my model card"
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)  # the workdir is shared by the module


_TEXT = "def f(x):\n\treturn x  # naïve 日本語 🙂"


@pytest.fixture(scope="module")
def byte_export(workdir, tmp_path_factory):
    out = tmp_path_factory.mktemp("byte_export") / "hf"
    result = _export(workdir, out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_hf_export_of_a_byte_run_writes_a_tokenizer_json_with_its_ids(byte_export):
    """Item 8: the export's tokenizer.json (read by the `tokenizers` library, a dependency)
    gives our byte ids and decodes them back."""
    from tokenizers import Tokenizer

    from nnx_zoo.data.tokenizers import ByteTokenizer

    tokenizer = Tokenizer.from_file(str(byte_export / "tokenizer.json"))
    ids = tokenizer.encode(_TEXT, add_special_tokens=False).ids
    assert ids == ByteTokenizer().encode(_TEXT)
    assert tokenizer.decode(ids) == _TEXT


def test_hf_export_of_a_byte_run_tokenizes_like_the_run_in_transformers(byte_export):
    """Item 8: transformers loads the export's tokenizer, and it gives our byte ids."""
    transformers = pytest.importorskip(
        "transformers", reason="the reference is transformers' AutoTokenizer (extra [hf])"
    )
    from nnx_zoo.data.tokenizers import ByteTokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(byte_export))
    ours = ByteTokenizer()
    ids = tokenizer(_TEXT, add_special_tokens=False)["input_ids"]
    assert ids == ours.encode(_TEXT)
    assert tokenizer.decode(ids) == _TEXT
    assert tokenizer.eos_token_id == ours.eos_id
