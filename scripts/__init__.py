"""draftsmith: train drafters for speculative decoding and measure what they are worth."""

__version__ = "0.1.0"


class DraftsmithError(Exception):
    """A user-facing error: one clear sentence, printed by the CLI without a stack trace."""
