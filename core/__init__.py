"""What every stage shares: the user error, file and folder safety, locks and rank coordination, the machine and
its threads, sampling, progress, retries, the method table, and where the serving engines are.

It imports nothing of draftsmith above it: data_gen and heads import only the core, train and eval the core,
data_gen and heads, and the commands (commands/: cli, export, publish, demo) everything (docs/layout.md)."""

__version__ = "0.1.0"


class DraftsmithError(Exception):
    """A user-facing error: one clear sentence, printed by the CLI without a stack trace."""
