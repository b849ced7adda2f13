"""absl's global flags for code that runs outside an absl app (a bench, a notebook, a user's
own script): libraries such as Grain read them as they start worker processes, and absl
raises `UnparsedFlagAccessError` while they are unparsed."""

from __future__ import annotations


def mark_parsed() -> None:
    """Mark absl's global FLAGS parsed if nothing parsed them: every flag keeps its default.
    Under an absl app (the flags already parsed) this changes nothing."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
