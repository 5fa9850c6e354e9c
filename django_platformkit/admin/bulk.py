"""The operator actions over every row a list's filter matches (Replay,
Discard, Cancel with Django admin's "Select all N" - ``select_across``):
which rows a confirmed action acts on, and what its confirmation page posts
back. A selection of rows on the page posts their ids; "all N" posts no
ids but the count and the highest primary key the confirmation counted, so
a filter of any size fits in a form (ids of every row overran Django's
``DATA_UPLOAD_MAX_NUMBER_FIELDS``, 1000, and the POST was refused), and
rows that arrived after the operator read "N" are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib import messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext as _

#: A selection's ids the confirmation page posts back (a page's worth at most; "all N" posts one).
SELECTED_IDS_LIMIT = 500


@dataclass(frozen=True)
class Selection:
    """What an action acts on.

    Attributes:
        rows: The rows: the selection, or every row the filter matches,
            bounded by ``upto`` once confirmed.
        across: "Select all N": every row the list's filter matches.
        upto: With ``across``: the highest primary key the confirmation
            page counted ("" before it was shown).
        confirmed_count: With ``across``: the count the operator confirmed (None before).
    """

    rows: QuerySet[Any]
    across: bool
    upto: str
    confirmed_count: int | None

    def form(self) -> dict[str, Any]:
        """What the confirmation page posts back to reach the same rows."""
        if self.across:
            first = self.rows.order_by("pk").values_list("pk", flat=True)[:1]
            last = self.rows.order_by("-pk").values_list("pk", flat=True)[:1]
            return {
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                # Django's changelist needs one checked row to route the POST to the action; select_across widens it.
                "selected_ids": [str(pk) for pk in first],
                "select_across": "1",
                "upto": str(last[0]) if last else "",
            }
        return {
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "selected_ids": [str(pk) for pk in self.rows.values_list("pk", flat=True)[:SELECTED_IDS_LIMIT]],
            "select_across": "0",
            "upto": "",
        }


def selection(request: HttpRequest, queryset: QuerySet[Any]) -> Selection:
    """The rows of ``queryset`` (what Django's action machinery passes: the
    checked rows, or the whole filtered list with ``select_across``) this
    request acts on; a confirmed "all N" stops at the ``upto`` it counted."""
    across = request.POST.get("select_across") == "1"
    upto = str(request.POST.get("upto") or "") if across else ""
    rows = queryset.filter(pk__lte=upto) if upto else queryset
    count = request.POST.get("count", "")
    return Selection(rows, across, upto, int(count) if across and count.isdigit() else None)


def nothing_matches(modeladmin: Any, request: HttpRequest, chosen: Selection, verb: str) -> bool:
    """Say so and return True when ``chosen`` holds no row: an empty filter
    ("all N" of nothing), or rows another operator acted on meanwhile."""
    if chosen.rows.exists():
        return False
    if chosen.across:
        text = _("Nothing matches the current filter: nothing to %(verb)s, nothing was written.") % {"verb": verb}
    else:
        text = _(
            "Nothing to %(verb)s: the selected rows are gone (acted on meanwhile?). The list below is what is left."
        ) % {"verb": verb}
    modeladmin.message_user(request, text, messages.WARNING)
    return True


def changed_since(chosen: Selection, acted: int) -> str:
    """A sentence when a confirmed "all N" found another count than N (rows
    acted on or gone meanwhile), else ""."""
    if chosen.confirmed_count is None or chosen.confirmed_count == acted:
        return ""
    return _("(%(confirmed)d matched the filter when you confirmed; %(now)d were still there.)") % {
        "confirmed": chosen.confirmed_count,
        "now": acted,
    }
