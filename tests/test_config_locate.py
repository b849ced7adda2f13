"""nnx_zoo/launch/config_files.py: `--config` finds the packaged configs by name or by the
checkout path the docs use, from any directory (an installed package has no ./configs), and a
real file wins."""

import os

from nnx_zoo.launch import config_files as locate


def test_the_shipped_configs_are_listed():
    assert {"tiny", "small", "llama3_1b", "llama3_8b"} <= set(locate.names())
    assert "locate" not in locate.names()


def test_a_name_or_the_checkout_path_finds_the_packaged_file_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./configs here
    packaged = os.path.join(locate.PACKAGE_DIR, "tiny.py")
    for value in ("tiny", "tiny.py", "configs/tiny.py", "./configs/tiny.py"):
        assert locate.config_path(value) == packaged, value
    # ml_collections' FILE:ARG form keeps its argument.
    assert locate.config_path("configs/tiny.py:x") == f"{packaged}:x"


def test_an_existing_file_wins_and_other_paths_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("configs")
    with open("configs/tiny.py", "w") as f:
        f.write("def get_config(): ...\n")
    assert locate.config_path("configs/tiny.py") == "configs/tiny.py"
    # Not a `configs` directory, or not a shipped name: the loader reports it as given.
    assert locate.config_path("elsewhere/tiny.py") == "elsewhere/tiny.py"
    assert locate.config_path("tinyy") == "tinyy"
    home = os.path.expanduser("~")
    assert locate.config_path("~/none.py") == os.path.join(home, "none.py")


def test_argv_rewrites_only_the_config_flag():
    argv = ["--config=tiny", "--config.training.steps=3", "--workdir=tiny"]
    out = locate.resolve_argv(argv)
    assert out[0] == f"--config={os.path.join(locate.PACKAGE_DIR, 'tiny.py')}"
    assert out[1:] == argv[1:]


def test_the_entry_points_config_flag_resolves_through_here(tmp_path, monkeypatch):
    """train_main / plan_main / explain_main's `--config` (nnx_zoo/launch/cli.py) from any
    directory."""
    from nnx_zoo.launch import cli

    monkeypatch.chdir(tmp_path)
    packaged = os.path.join(locate.PACKAGE_DIR, "llama3_1b.py")
    assert cli._resolve_config_path("configs/llama3_1b.py") == packaged
    assert cli._resolve_config_path("llama3_1b") == packaged
    assert os.path.samefile(cli.DEFAULT_CONFIG, os.path.join(locate.PACKAGE_DIR, "tiny.py"))
