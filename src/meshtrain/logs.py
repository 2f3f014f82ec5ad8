"""Logging: one `meshtrain` logger. Rank 0 prints everything at `run.log_level` through a rich
console (colours and the progress bar on a terminal, plain lines in a batch system's log file);
every other rank prints its warnings and errors to stderr, prefixed with its rank, so a problem
seen by one rank alone is not lost. Metrics go to their own sinks (metrics.MetricsLogger)."""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.markup import escape

log = logging.getLogger("meshtrain")
LEVELS = ("debug", "info", "warning", "error")
_STYLES = {logging.WARNING: "yellow", logging.ERROR: "bold red", logging.CRITICAL: "bold red"}
_console: Console | None = None


class ConsoleHandler(logging.Handler):
    """Rank 0: records through the rich console that also draws the progress bar."""

    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            style = _STYLES.get(record.levelno)
            prefix = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
            self.console.print(escape(prefix + message), style=style)
        except Exception:  # a logging failure must never end training
            self.handleError(record)


def write_line(text: str, stream=None) -> None:
    """`text` and its newline in one write. Under mpirun or srun every rank's stdout is merged into
    one stream; print() writes the newline separately (unbuffered Python, PYTHONUNBUFFERED=1), so
    another rank's line could land between a line and its end."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def console() -> Console:
    """The rank-0 console (plain when stdout is not a terminal)."""
    global _console
    if _console is None:
        tty = sys.stdout.isatty()
        _console = Console(highlight=False, soft_wrap=True, force_terminal=tty, no_color=not tty)
    return _console


def setup_logging(rank: int = 0, level: str = "info") -> None:
    """Idempotent: the launcher process and each worker call it once they know their rank."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
    if rank == 0:
        handler: logging.Handler = ConsoleHandler(console())
        handler.setLevel(level.upper())
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s: %(message)s"))
        handler.setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
