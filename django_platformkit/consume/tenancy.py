"""The tenant a handler runs in: ``TENANT_CONTEXT``, and the ``set_config``
that row-level-security policies read (``current_setting('platformkit.tenant',
true)``), spelled here once and used by the claim statement too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections
from django.utils.module_loading import import_string

from django_platformkit import conf
from django_platformkit.exceptions import ConfigurationError

#: The statement that sets the tenant for row-level-security policies, for
#: the rest of the transaction (``is_local`` = true); one parameter, the
#: tenant ('' for none). ``TENANT_SET_CONFIG`` is the call itself, for a
#: statement that sets the tenant among other things (the consumer's claim
#: statement, ``claim._claim_sql``).
TENANT_SET_CONFIG = "set_config('platformkit.tenant', %s, true)"
SET_TENANT_SQL = f"SELECT {TENANT_SET_CONFIG}"


@contextlib.contextmanager
def set_config_tenant(tenant: str | None) -> Iterator[None]:
    """The default ``TENANT_CONTEXT``: inside the handler's transaction,
    ``current_setting('platformkit.tenant', true)`` returns the event's tenant
    ('' for none), so row-level-security policies can read it."""
    alias = conf.settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute(SET_TENANT_SQL, [tenant or ""])
    yield


def tenant_context_factory() -> Callable[[str | None], contextlib.AbstractContextManager[Any]]:
    """``TENANT_CONTEXT`` imported: a ``(tenant or None) -> context manager``
    callable; ``set_config_tenant`` when the setting is None (the default).
    Raises ``ConfigurationError`` if the path does not import."""
    path = conf.settings.TENANT_CONTEXT
    if path is None:
        return set_config_tenant
    try:
        factory: Callable[[str | None], contextlib.AbstractContextManager[Any]] = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(f"PLATFORMKIT['TENANT_CONTEXT'] = {path!r} can't be imported: {exc}") from exc
    return factory
