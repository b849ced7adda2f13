"""What a run changes for its own length and puts back after (issue 48, item 3): absl's
verbosity (`cli.quiet_logging`), what is kept off stderr around a failed checkpoint save
(`write_errors.failed_saves_said_once`), the harness's logger and environment."""

from __future__ import annotations

import logging
import os
import sys

from absl import flags
from absl import logging as absl_logging

from nnx_zoo.checkpoint import write_errors
from nnx_zoo.evaluation import harness
from nnx_zoo.launch import cli


def _record(logger: str, message: str, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    return logging.getLogger(logger).makeRecord(
        logger, logging.ERROR, __file__, 1, message, None, exc_info
    )


def _raised_in(filename: str) -> BaseException:
    try:
        exec(compile("raise OSError(28, 'No space left on device')", filename, "exec"))
    except OSError as e:
        return e
    raise AssertionError("not raised")


def _kept(logger: str, record: logging.LogRecord) -> bool:
    filters = logging.getLogger(logger).filters
    return all(f(record) if callable(f) else f.filter(record) for f in filters)


def test_failed_save_noise_is_dropped_only_inside_the_run():
    orbax_write = _raised_in("/site-packages/orbax/checkpoint/_src/serialization/fake.py")
    never_retrieved = _record("asyncio", "Task exception was never retrieved", orbax_write)
    own_task = _record("asyncio", "Task exception was never retrieved", _raised_in("/app/mine.py"))
    hook = sys.unraisablehook
    filters = {name: list(logging.getLogger(name).filters) for name in ("asyncio", "absl")}
    with write_errors.failed_saves_said_once():
        assert not _kept("asyncio", never_retrieved)
        # Not Orbax's write: the user's own asyncio failures still print.
        assert _kept("asyncio", own_task)
        assert _kept("asyncio", _record("asyncio", "Exception in callback"))
        assert sys.unraisablehook is not hook
    assert sys.unraisablehook is hook
    assert {name: logging.getLogger(name).filters for name in filters} == filters
    assert _kept("asyncio", never_retrieved)


def test_a_hook_installed_during_the_run_is_left_to_its_installer():
    hook = sys.unraisablehook

    def theirs(unraisable):
        hook(unraisable)

    try:
        with write_errors.failed_saves_said_once():
            sys.unraisablehook = theirs
        assert sys.unraisablehook is theirs
    finally:
        sys.unraisablehook = hook


def test_quiet_logging_lasts_as_long_as_the_entry_points_main():
    verbosity = flags.FLAGS["verbosity"]
    assert not verbosity.present  # the suite's own command line gives no --verbosity
    before = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.INFO)
    try:
        seen = []

        @cli.quiet_logging()
        def main():
            seen.append(absl_logging.get_verbosity())

        main()
        main()  # a decorator each call enters afresh
        assert seen == [absl_logging.WARNING] * 2
        assert absl_logging.get_verbosity() == absl_logging.INFO
        verbosity.present = 1  # --verbosity given: the user's, untouched
        try:
            main()
        finally:
            verbosity.present = 0
        assert seen[-1] == absl_logging.INFO
    finally:
        absl_logging.set_verbosity(before)


def test_the_harness_settings_are_put_back(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the user's value wins
    logger = logging.getLogger("lm_eval")
    level = logger.level
    with harness._harness_settings():
        assert os.environ["HF_HUB_OFFLINE"] == "1"
        assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
        assert logger.level == logging.ERROR
    assert "HF_HUB_OFFLINE" not in os.environ
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    assert logger.level == level
