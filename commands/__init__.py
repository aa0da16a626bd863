"""draftsmith: train drafters for speculative decoding and measure what they are worth.

This folder (commands/) is the package root: the `draftsmith` command (cli.py) and the stages above train and eval
(export, publish, demo), and the method rows (methods.py). The rest is mapped in from the card's folders
(docs/layout.md)."""

from draftsmith.core import DraftsmithError, __version__
from . import methods  # noqa: F401  (registers the method rows: Python imports this package before any stage)

__all__ = ["DraftsmithError", "__version__"]
