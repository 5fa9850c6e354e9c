"""What every command shares: ``--verbosity`` mapped to the package's logging."""

import logging
import sys

LEVELS = {0: logging.ERROR, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def configure_logging(verbosity: int) -> None:
    """Send ``django_platformkit`` logs to stderr at the level ``--verbosity``
    asks for, unless the project's LOGGING already handles them."""
    logger = logging.getLogger("django_platformkit")
    logger.setLevel(LEVELS.get(verbosity, logging.INFO))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)
