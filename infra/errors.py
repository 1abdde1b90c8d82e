"""The error type for a user's mistake (a config field, a flag, an input file)."""


class UserInputError(ValueError):
  """A mistake in the user's input, not a bug: the CLIs report it as one line, no traceback.

  The message names the file, line or field at fault and what would be accepted.
  """


class RunStopped(RuntimeError):
  """A run that stopped on purpose for a stated reason (a dead simulator, too many failed
  updates, too few scored profiles): the CLIs report it as one line and exit non-zero."""


class MissingInputError(UserInputError, FileNotFoundError):
  """A file or directory that the user named, or that one must contain, is not there."""
