"""User-facing errors.

Every problem a user can cause (bad input, a wrong model pair, a broken checkpoint) raises
`UserError` with one sentence naming the problem and the fix. The CLI prints that sentence on
one line and exits non-zero; anything else escaping is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input or files; its message says what to do about it."""


def run_main(fn, argv=None, interrupted: str = "nothing half-done was kept") -> int:
    """Run a command's body `fn(argv)` the way every `main()` should end.

    UserError: one `error: ...` line, exit 2 (the message already says what to do).
    Ctrl-C: one line, `interrupted: <interrupted>`, exit 130 (128 + SIGINT, what shells expect);
    `interrupted` says what was kept and how to resume, since that is what the user needs next.
    Otherwise the body's return value (None = 0).
    """
    import sys

    try:
        rc = fn(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {interrupted}", file=sys.stderr)
        return 130
    return 0 if rc is None else int(rc)


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none): what an error
    line quotes from a library's multi-line message."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
