"""What every CLI verb shares: one-line errors, the exit codes, leftovers announced.

Whatever a verb raises ends as one line, ``embedq: error: <file or step>: <what>``:
an :class:`EmbedqError` as it is (exit 2), an ``OSError`` with the file it names (or the
verb's output when it names none), anything else with its type and
"(unexpected: set EMBEDQ_DEBUG=1 for the traceback)" (exit 1).
"""

from __future__ import annotations

import os
from pathlib import Path

import click
import typer

from embedq.errors import EmbedqError

UNEXPECTED = "(unexpected: set EMBEDQ_DEBUG=1 for the traceback)"


def debug() -> bool:
    return os.environ.get("EMBEDQ_DEBUG", "") not in ("", "0")


# what str.splitlines() breaks at: inside an error line (a path, a value) they are escaped,
# so the line stays one line
_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped (``\\r``, ``\\x1c``)."""
    return "".join(ch.encode("unicode_escape").decode("ascii") if ch in _BREAKS or
                   (ord(ch) < 32 and ch != "\t") else ch for ch in text)


def say_error(line: str) -> None:
    typer.echo(f"embedq: error: {one_line(line)}", err=True)


def fail(e: Exception) -> None:
    say_error(str(e))
    raise typer.Exit(getattr(e, "exit_code", 2))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def describe(e: BaseException, where: str | os.PathLike | None) -> tuple[str, int]:
    """The error line (after ``embedq: error: ``) and exit code for ``e``."""
    if isinstance(e, EmbedqError):
        return str(e), getattr(e, "exit_code", 2)
    if isinstance(e, OSError):
        name = getattr(e, "filename", None) or where or "embedq"
        return f"{name}: {e.strerror or _first_line(e) or type(e).__name__}", 2
    if isinstance(e, MemoryError):
        return f"{where or 'embedq'}: out of memory (MemoryError); free memory or use a machine with more", 1
    what = _first_line(e)
    return f"{where or 'embedq'}: {type(e).__name__}{': ' + what if what else ''} {UNEXPECTED}", 1


def _where(fn, args, kwargs) -> str | None:
    """What to name in an error without a file: the verb's output, else its first path."""
    for key in ("output", "out", "folder"):
        if kwargs.get(key) is not None:
            return str(kwargs[key])
    for a in args:
        if isinstance(a, (str, Path)):
            return str(a)
    return getattr(fn, "__name__", None)


def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; every exception it raises ends as one error line."""
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        typer.echo("embedq: interrupted; the source checkpoint is unchanged", err=True)
        raise typer.Exit(130)
    except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
        raise  # typer's own exits (Exit and Abort are RuntimeErrors)
    except Exception as e:
        if debug() and not isinstance(e, EmbedqError):
            raise
        line, code = describe(e, _where(fn, args, kwargs))
        say_error(line)
        raise typer.Exit(code)


def announce_leftovers(folder: Path, names: list[str]) -> None:
    """One line for what a killed run left behind and this run removed."""
    shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
    typer.echo(f"embedq: removed {len(names)} leftover(s) of an interrupted run in {folder}: {shown}",
               err=True)


def quiet_libraries() -> None:
    """Library warnings go to the log, not between a command and its result or error line
    (EMBEDQ_DEBUG=1 shows them)."""
    import logging
    import warnings
    if debug():
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.captureWarnings(True)
    w = logging.getLogger("py.warnings")
    w.addHandler(logging.NullHandler())
    w.propagate = False
    warnings.simplefilter("default")  # recorded (to the log), never printed
