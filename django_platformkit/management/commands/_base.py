"""What every command shares: ``--verbosity`` mapped to the package's logging
and to the command's own lines (``Output``: ``-v 0`` prints errors and the
data asked for only; ``-v`` accepted after a subcommand too), outcome words
in ``self.style``'s colours (``--no-color`` honoured), the ``--actor`` check,
``--metrics-port`` and ``--metrics-host``, the refusal of a number option that can't mean anything
(in ``handle()``, so ``call_command`` is refused too), the reading of ages
(``12h``) and points in time (``2h`` ago, or ISO 8601), and a complete
registry of subscriptions and events whether or not the checks ran."""

import argparse
import contextlib
import logging
import math
import re
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

LEVELS = {0: logging.ERROR, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def command_version(command: object = None) -> str:
    """What ``--version`` prints for the long-running commands, runworker and
    runrelay (their ``get_version``): this release, then Django's and
    Python's versions. Django's default prints Django's version alone."""
    import platform

    import django

    from django_platformkit._version import __version__

    return f"django-platformkit {__version__} (Django {django.get_version()}, Python {platform.python_version()})"


def accept_verbosity(subparser: Any) -> Any:
    """Let a subcommand take ``-v``/``--verbosity`` after its name too
    (``deadletters list -v 0``): argparse gives a subparser none of its
    parent's options, so that was an error (status 2). Given there, it wins;
    left out, the parent's stands (``SUPPRESS``: the subparser sets nothing).
    Returns ``subparser``."""
    subparser.add_argument(
        "-v",
        "--verbosity",
        type=int,
        choices=[0, 1, 2, 3],
        default=argparse.SUPPRESS,
        help="Verbosity level; 0=errors and the data asked for only, 1=normal output, 2=every row, 3=very verbose.",
    )
    return subparser


class Output:
    """A command's own lines, by what they are, at Django's verbosity
    levels: ``data`` (what was asked for: a list, a document) always;
    ``result`` (what was done, its outcome word coloured) and ``warning``
    from 1; ``detail`` (one line per row) from 2. Errors are
    ``CommandError``s, which Django prints at every level. Colours are
    ``command.style``'s: none with ``--no-color`` or off a terminal.

    Args:
        command: The running command (its ``stdout``, ``stderr``, ``style``).
        verbosity: ``options["verbosity"]``.
    """

    def __init__(self, command: Any, verbosity: int) -> None:
        self.command = command
        self.verbosity = int(verbosity)
        self.style = command.style

    def data(self, text: str, **kwargs: Any) -> None:
        self.command.stdout.write(text, **kwargs)

    def result(self, word: str, rest: str = "", *, style: str = "SUCCESS") -> None:
        """``word`` (coloured: ``style`` is a ``self.style`` role, e.g.
        ``SUCCESS``, ``WARNING``, ``NOTICE``, ``ERROR``) then ``rest``."""
        if self.verbosity >= 1:
            self.command.stdout.write(getattr(self.style, style)(word) + (f" {rest}" if rest else ""))

    def line(self, text: str) -> None:
        """A result line with nothing to colour (``key=value`` totals), from 1."""
        if self.verbosity >= 1:
            self.command.stdout.write(text)

    def warning(self, word: str, rest: str = "") -> None:
        if self.verbosity >= 1:
            self.command.stderr.write(self.style.WARNING(word) + (f" {rest}" if rest else ""))

    def progress(self, text: str) -> None:
        """How far a long run has got, on stderr (stdout stays the result), from 1."""
        if self.verbosity >= 1:
            self.command.stderr.write(text)

    def detail(self, text: str) -> None:
        if self.verbosity >= 2:
            self.command.stdout.write(text)


def configure_logging(verbosity: int) -> None:
    """Send ``django_platformkit`` logs to stderr at the level ``--verbosity``
    asks for, unless the project's LOGGING already handles them."""
    logger = logging.getLogger("django_platformkit")
    logger.setLevel(LEVELS.get(verbosity, logging.INFO))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)


def positive(
    option: str, value: Any, *, unit: str = "seconds", whole: bool = False, example: str = "30", omitted: str = ""
) -> Any:
    """``value`` of ``option`` (such as ``--burst-timeout``) if it is a finite
    number above 0 (a whole one with ``whole``); None (not given) as it is.
    Anything else is a ``CommandError`` that says what to pass (``omitted``:
    what leaving the option out does). Checked in ``handle()``, not by an
    argparse ``type=``, so ``call_command(..., burst_timeout=-5)`` is refused
    too: a negative timeout gave up at once and said "not drained after -5.0s"."""
    from django.core.management.base import CommandError

    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0 and (not whole or number == int(number))):
        kind = "a whole number" if whole else "a number"
        raise CommandError(
            f"{option} {value}: give {kind} of {unit} above 0 (e.g. {option} {example})"
            + (f"; {omitted}." if omitted else ".")
        )
    return int(number) if whole else number


def import_urlconf() -> None:
    """Import the project's URLconf (``ROOT_URLCONF``), as Django's system
    checks do before every command: a ``@subscribe`` or ``declare()`` in a
    module only the URLconf imports (a ``views.py``) is then in the registry
    with ``--skip-checks`` too, not only when the checks happened to import
    it. Every command that reads the registry (``runworker``, ``deadletters``,
    ``purgeoutbox``, ``republish``, ``platformkit_asyncapi``) calls this first, so none of
    them serves, guards or documents less than the others. Declarations
    belong in ``<app>/platformkit.py``, which the app imports itself. A
    URLconf that fails to import raises, as ``manage.py check`` would say."""
    from django.conf import settings

    if getattr(settings, "ROOT_URLCONF", None):
        from django.urls import get_resolver

        get_resolver().url_patterns  # noqa: B018 - importing is the point


def parsed[T](option: str, value: Any, read: Callable[[Any], T]) -> T | None:
    """``value`` of ``option`` (such as ``--older-than``) as ``read`` takes
    it, ``read`` being the option's argparse ``type=``, which accepts its
    text and the value it returns; None (not given) as it is. Called in
    ``handle()``: ``call_command("purgeoutbox", older_than="0d")`` skips
    argparse, and went on with a value the command line refuses. Raises
    the ``CommandError`` the parser raises for ``call_command``, word for
    word: ``Error: argument --older-than: '0d' is not an age ...``."""
    from django.core.management.base import CommandError

    if value is None:
        return None
    try:
        return read(value)
    except argparse.ArgumentTypeError as exc:
        raise CommandError(f"Error: argument {option}: {exc}") from None


_AGE = re.compile(r"^([0-9]+)([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
#: What a point-in-time option takes, as its error message says it.
WHEN_EXAMPLES = "an age such as 30m, 12h, 7d or 2w (that long ago) or an ISO 8601 time such as 2026-12-02T06:00:00Z"


def age(text: str | timedelta) -> timedelta:
    """``30m``, ``12h``, ``7d``, ``2w`` (also ``s``) -> a positive timedelta.
    A timedelta (what this returns, or ``call_command(older_than=...)``) is
    checked the same way and returned as it is."""
    shown = repr(text) if isinstance(text, str) else str(text)
    not_an_age = argparse.ArgumentTypeError(f"{shown} is not an age such as 30m, 12h, 7d or 2w")
    try:
        if isinstance(text, timedelta):
            value = text
        else:
            match = _AGE.match(str(text).strip())
            if match is None:
                raise not_an_age
            value = timedelta(**{_UNITS[match[2]]: int(match[1])})
        if value <= timedelta(0):
            raise not_an_age
        datetime.now(UTC) - value  # the cutoff must be a date
    except OverflowError:
        raise argparse.ArgumentTypeError(
            f"{shown} reaches back before the year 1; give an age such as 520w (ten years)"
        ) from None
    return value


def point_in_time(option: str, value: Any) -> timedelta | datetime | None:
    """``value`` of ``option`` (such as ``--since``) as an age before now (a
    positive timedelta: ``2h``) or an aware datetime (ISO 8601; one without
    an offset is read as UTC); None (not given) as it is. A timedelta or
    datetime from ``call_command`` is checked the same way. Anything else is
    a ``CommandError`` that says what to pass."""
    from django.core.management.base import CommandError

    if value is None:
        return None
    if isinstance(value, timedelta):
        if value > timedelta(0):
            return value
    elif isinstance(value, datetime):
        return value if value.tzinfo is not None and value.utcoffset() is not None else value.replace(tzinfo=UTC)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        if _AGE.match(text):
            try:
                return age(text)
            except argparse.ArgumentTypeError as exc:
                raise CommandError(f"{option} {value}: {exc}.") from None
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            pass
        else:
            return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    raise CommandError(f"{option} {value!r}: give {WHEN_EXAMPLES}.")


def tcp_port(option: str, value: Any) -> Any:
    """``value`` of ``option`` if it is a TCP port (0-65535), None as it is;
    else a ``CommandError``. A command checks it before it starts anything,
    in every mode (``--processes`` too)."""
    from django.core.management.base import CommandError

    if value is not None and not (isinstance(value, int) and 0 <= value <= 65535):
        raise CommandError(f"{option} {value}: not a TCP port (0-65535).")
    return value


#: ``--metrics-host``'s default: this machine only. In a container whose
#: metrics a Prometheus on another host scrapes, pass ``--metrics-host 0.0.0.0``.
DEFAULT_METRICS_HOST = "127.0.0.1"


def add_metrics_options(parser: Any) -> None:
    """``--metrics-port PORT`` and ``--metrics-host HOST`` (runworker, runrelay)."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (needs the metrics extra).",
    )
    parser.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        metavar="HOST",
        help=f"The address --metrics-port listens on (default {DEFAULT_METRICS_HOST}: this machine only; "
        "0.0.0.0 for every interface, e.g. in a container Prometheus scrapes from outside).",
    )


def start_metrics(port: int, *, host: str = DEFAULT_METRICS_HOST, **kwargs: Any) -> Any:
    """``--metrics-port PORT`` on ``--metrics-host HOST``: serve ``/metrics``
    from this process (see ``django_platformkit.runtime.metrics.serve_metrics``
    for ``kwargs``). Raises ``CommandError`` saying what to do when
    prometheus-client is missing, the port is out of range or taken, or the
    host is no address of this machine."""
    from django.core.management.base import CommandError

    from django_platformkit.exceptions import ConfigurationError

    tcp_port("--metrics-port", port)
    try:
        from django_platformkit.runtime.metrics import serve_metrics

        return serve_metrics(port, addr=host, **kwargs)
    except ConfigurationError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(
            f"--metrics-host {host} --metrics-port {port}: can't listen there ({exc}); pick a free port, or an "
            "address of this machine."
        ) from None


def serve_tree_metrics(port: int, *, host: str = DEFAULT_METRICS_HOST, subscriptions: Any = ()) -> Any:
    """``--processes N --metrics-port PORT``: make the folder the children
    count into and serve their sum from this process (a ``TreeMetrics``;
    see ``django_platformkit.runtime.treemetrics``). Raises ``CommandError``
    as ``start_metrics`` does."""
    from django.core.management.base import CommandError

    from django_platformkit.exceptions import ConfigurationError

    tcp_port("--metrics-port", port)
    try:
        from django_platformkit.runtime.treemetrics import TreeMetrics

        tree = TreeMetrics(subscriptions=subscriptions)
    except ConfigurationError as exc:
        raise CommandError(str(exc)) from None
    try:
        tree.serve(port, host)
    except OSError as exc:
        tree.close()
        raise CommandError(
            f"--metrics-host {host} --metrics-port {port}: can't listen there ({exc}); pick a free port, or an "
            "address of this machine."
        ) from None
    return tree


@contextlib.contextmanager
def result_printed_once(logger_name: str, *prefixes: str) -> Iterator[None]:
    """While a command prints its result on stdout, drop the library's log
    record that says the same thing (a message starting with one of
    ``prefixes``), so a terminal shows the result once. Other records of that
    logger pass; the project's own handlers still get them from other callers."""

    def keep(record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(prefixes))

    logger = logging.getLogger(logger_name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


@contextlib.contextmanager
def tables_migrated() -> Iterator[None]:
    """Turn "relation ... does not exist" (SQLSTATE 42P01) into a one-line
    ``CommandError`` that says to migrate, as ``runworker`` says it: an
    operator command on a database without our tables, not a traceback.
    A database that can't answer (refused, down, starting) is one line too,
    as ``runworker`` and ``stream`` say it."""
    from django.core.management.base import CommandError
    from django.db import DatabaseError, ProgrammingError

    from django_platformkit.outage import database_unavailable, sqlstate

    try:
        yield
    except ProgrammingError as exc:
        if sqlstate(exc) != "42P01":
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "a table is missing"
        raise CommandError(f"{first_line}: run `manage.py migrate django_platformkit` first.") from None
    except DatabaseError as exc:
        if not database_unavailable(exc):
            raise
        raise CommandError(
            f"the database is unavailable ({' '.join(str(exc).split()) or type(exc).__name__}): run the command "
            "again once it answers (check DATABASES, or PGHOST/PGPORT where they are left out)."
        ) from None


def checked_actor(command: str, username: str) -> Any:
    """The Django user ``--actor USERNAME`` names, checked alike by every
    command that takes ``--actor`` (``deadletters replay|discard``,
    ``cancel``, ``pause``, ``resume``, ``jobs``): an active user holding the permission the admin's own
    action needs (``operate.audit.acting_user``), before anything is read
    or written. Returns the user's primary key (None without
    ``django.contrib.auth``: no user to check, the name is recorded as given).

    Raises:
        CommandError: ``<command> --actor USERNAME: refused, nothing written: <why>``,
            or a blank ``--actor``.
    """
    from django.core.management.base import CommandError

    from django_platformkit.operate.audit import acting_user

    if not str(username or "").strip():
        raise CommandError(f"{command}: give --actor USERNAME, who acts (kept in the log); nothing was written.")
    try:
        return acting_user(username)
    except ValueError as exc:
        raise CommandError(f"{command} --actor {username}: refused, nothing written: {exc}") from None
