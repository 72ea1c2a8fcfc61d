"""User-facing errors and notices.

Every problem a user can cause raises `UserError` with one sentence naming the problem and the fix; the
CLI prints it on one line and exits non-zero, while anything else escaping is a bug and keeps its
traceback. Everything else goes through `logging` under the "adaptive_spec" logger, which (as in
transformers) has one handler of its own writing to whatever sys.stderr is at the time. Quieter:
`logging.getLogger("adaptive_spec").setLevel(logging.WARNING)`."""
import logging
import signal
import sys
import threading


class _Stderr(logging.Handler):
    """INFO as the message alone, WARNING and up as `warning: message`: the CLI's own style."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
            print(prefix + record.getMessage(), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's own contract: never raise from emit
            self.handleError(record)


_ROOT = logging.getLogger("adaptive_spec")
if not any(isinstance(h, _Stderr) for h in _ROOT.handlers):
    _ROOT.addHandler(_Stderr())
    _ROOT.setLevel(logging.INFO)
    _ROOT.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


class UserError(Exception):
    """A problem with the user's input or files; its message says what to do about it."""


def run_main(fn, argv=None, interrupted: str = "nothing half-done was kept") -> int:
    """Run a command's body `fn(argv)` the way every `main()` should end.

    UserError: one `error: ...` line, exit 2 (the message already says what to do).
    Ctrl-C: one line, `interrupted: <interrupted>`, exit 130 (128 + SIGINT, what shells expect);
    `interrupted` says what was kept and how to resume, since that is what the user needs next.
    SIGTERM (`kill`, a scheduler's stop) takes the same path, exit 143: a job started in the
    background by a script has SIGINT ignored, and must still stop cleanly.
    Otherwise the body's return value (None = 0)."""
    def on_term(signum, frame):
        raise _Terminated

    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, on_term)
    try:
        rc = fn(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"\ninterrupted: {interrupted}", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return 0 if rc is None else int(rc)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so every cleanup that handles one handles both."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none): what an error
    line quotes from a library's multi-line message."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
