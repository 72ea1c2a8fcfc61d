"""User-facing errors.

Every problem a user can cause (bad input, a wrong model pair, a broken checkpoint) raises
`UserError` with one sentence naming the problem and the fix. The CLI prints that sentence on
one line and exits non-zero; anything else escaping is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input or files; its message says what to do about it."""
