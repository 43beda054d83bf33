"""The one error type of checkpoint reading and writing."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and what to do."""
