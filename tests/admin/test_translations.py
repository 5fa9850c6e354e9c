"""Every user-facing string of the console goes through gettext: rendered
under a test translation that marks each string it is asked for (⟪…⟫), the
pages show no English word of ours unmarked; and, without rendering, every
template text sits in {% translate %} / {% blocktranslate %} and every admin
label, filter title and message is a gettext call.

And every such string has a translation in the catalogues the wheel ships
(German, French, Spanish): each page rendered in each language under that
language's real catalogue, which marks ⟪…⟫ only a string it has no
translation for, shows none; the catalogues, regenerated from the code with
makemessages, have no new or fuzzy entry; and each django.mo is its
django.po compiled (``.ci/messages`` does all three for a maintainer)."""

from __future__ import annotations

import ast
import datetime
import functools
import gettext as gettext_module
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.template.base import Lexer, TokenType
from django.urls import reverse
from django.utils import timezone, translation
from django.utils.translation import trans_real

from django_platformkit import publish
from django_platformkit.models import Attempt, DeadLetter, JobState, OutboxEvent
from django_platformkit.outbox.deadletters import record_dead_letter
from django_platformkit.runtime.heartbeat import Heartbeat

PACKAGE = Path(__file__).resolve().parents[2] / "django_platformkit"
TEMPLATES = PACKAGE / "templates" / "admin" / "django_platformkit"
#: The catalogues the wheel ships (django_platformkit/locale/<language>/LC_MESSAGES).
LANGUAGES = ["de", "fr", "es"]


class Marking(gettext_module.NullTranslations):
    """A test language: every string asked for comes back marked ⟪…⟫, so a
    string that never went through gettext stands out unmarked."""

    def gettext(self, message: str) -> str:
        if trans_real.CONTEXT_SEPARATOR in message:  # pgettext: "context\x04message"
            message = message.split(trans_real.CONTEXT_SEPARATOR, 1)[1]
        return f"⟪{message}⟫"

    def ngettext(self, singular: str, plural: str, n: int) -> str:
        return f"⟪{singular if n == 1 else plural}⟫"

    def language(self) -> str:
        return "xx"

    def to_language(self) -> str:
        return "xx"


@contextmanager
def marked() -> Iterator[None]:
    trans_real._active.value = Marking()
    try:
        yield
    finally:
        translation.deactivate()


class Untranslated(gettext_module.NullTranslations):
    """A language as Django has it (our catalogue merged with Django's and
    every app's), except that a string that catalogue has no translation for
    comes back marked ⟪…⟫ instead of in English, and is kept in ``missing``
    (its msgid, without a context)."""

    def __init__(self, language: str) -> None:
        super().__init__()
        self.real = trans_real.translation(language)
        self.known = self.real._catalog  # msgid, "context\x04msgid", or (msgid, plural form)
        self.missing: set[str] = set()

    def _marked(self, message: str) -> str:
        self.missing.add(message.split(trans_real.CONTEXT_SEPARATOR)[-1])
        return f"⟪{message.split(trans_real.CONTEXT_SEPARATOR)[-1]}⟫"

    def gettext(self, message: str) -> str:
        if message in self.known:
            return self.real.gettext(message)
        return self._marked(message)

    def ngettext(self, singular: str, plural: str, n: int) -> str:
        if (singular, 0) in self.known:
            return self.real.ngettext(singular, plural, n)
        self._marked(singular)
        return f"⟪{(singular if n == 1 else plural).split(trans_real.CONTEXT_SEPARATOR)[-1]}⟫"

    def language(self) -> str:
        return self.real.language()

    def to_language(self) -> str:
        return self.real.to_language()


@contextmanager
def untranslated_marked(language: str) -> Iterator[Untranslated]:
    active = trans_real._active.value = Untranslated(language)
    try:
        yield active
    finally:
        translation.deactivate()


@functools.cache
def djangos_own_strings() -> frozenset[str]:
    """Every msgid of Django's own catalogues (its English sources): Django's
    to translate, and some new ones aren't yet ("Pagination %(name)s")."""
    import django

    root = Path(django.__file__).parent
    found: set[str] = set()
    for po in [root / "conf" / "locale", *(root / "contrib").glob("*/locale")]:
        text = (po / "en" / "LC_MESSAGES" / "django.po").read_text() if (po / "en").exists() else ""
        for pieces in re.findall(r'^msgid ((?:"(?:[^"\\]|\\.)*"\n?)+)', text, re.M):
            found.add("".join(re.findall(r'"((?:[^"\\]|\\.)*)"', pieces)).encode().decode("unicode_escape"))
    return frozenset(found)


class _Text(HTMLParser):
    """The text a reader sees, and the title / aria-label texts, of ``#content``
    (Django's own header, navigation and footer are Django's to translate)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 inside #content
        self.skip = 0  # > 0 inside <style>/<script>/<pre>/<code> (data, not words of ours)
        self.parts: list[str] = []
        self.glued = False  # a <wbr> (a line-break chance inside a name): the text goes on as one word

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "wbr":
            self.glued = True
            return
        if self.depth or found.get("id") == "content":
            if tag not in ("br", "input", "meta", "img", "link", "hr"):
                self.depth += 1
            if tag in ("style", "script", "pre", "code", "textarea"):
                self.skip += 1
            said = [found.get("title"), found.get("aria-label")]
            if tag == "input" and found.get("type") == "submit":
                said.append(found.get("value"))
            self.parts.extend(text for text in said if text)

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag not in ("br", "input", "meta", "img", "link", "hr"):
            self.depth -= 1
            if tag in ("style", "script", "pre", "code", "textarea"):
                self.skip -= 1

    def handle_data(self, data: str) -> None:
        if self.depth and not self.skip:
            if self.glued and self.parts:
                self.parts[-1] += data
            else:
                self.parts.append(data)
        self.glued = False


# Data the pages show as it is: names, ids, paths, times, numbers, what handlers raised.
_DATA = [
    r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} [A-Z]{2,5}",  # a time, in the console's one format
    r"[\w.:/@*-]*[\d._:/@-][\w.:/@*-]*",  # names with dots, ids, host:pid, URLs, numbers, durations' digits
]


def unmarked_words(html: str, data: list[str]) -> list[str]:
    parser = _Text()
    parser.feed(html)
    text = " ".join(parser.parts)
    for value in sorted(data, key=len, reverse=True):
        # Whole values only: a payload key such as "n" must not cut words in two.
        text = re.sub(rf"(?<!\w){re.escape(value)}(?!\w)", " ", text)
    while (unwrapped := re.sub(r"⟪[^⟪⟫]*⟫", " ", text)) != text:  # marked (translated), innermost first
        text = unwrapped
    for pattern in _DATA:
        text = re.sub(pattern, " ", text)
    return re.findall(r"[A-Za-z]{2,}", text)


@pytest.fixture
def operator() -> User:
    return User.objects.create_superuser(f"op{uuid.uuid4().hex[:6]}", password=None)


@pytest.fixture
def scene(registries) -> dict[str, object]:
    """Something on every page: a failing subscription (a retry and a dead
    letter), a lagging one, an overdue job, a live and a folded worker, a task."""
    from django_platformkit.jobs import specs as jobs

    with transaction.atomic():
        failed, retrying = publish("testapp.flaky", {"n": 1}), publish("testapp.flaky", {"n": 2})
        waiting = publish("testapp.slow", {"n": 3})
    OutboxEvent.objects.filter(pk=failed).update(published_at=timezone.now())
    OutboxEvent.objects.filter(pk=waiting).update(created_at=timezone.now() - datetime.timedelta(minutes=5))
    record_dead_letter(
        subscription="testapp.flaky",
        event_id=failed,
        name="testapp.flaky",
        tenant=None,
        attempts=3,
        error="KeyError: 'sku'",
        traceback="Traceback ...",
    )
    Attempt.objects.create(
        subscription="testapp.flaky", event_id=retrying, attempt=1, outcome=Attempt.FAILED, error="KeyError: 'sku'"
    )
    jobs.job(every=datetime.timedelta(seconds=20), name="testapp.sync_prices")(lambda: None)
    late = timezone.now() - datetime.timedelta(seconds=82)
    JobState.objects.create(name="testapp.sync_prices", last_slot=late, started_at=late, finished_at=late)
    Heartbeat(["testapp.flaky"], worker="web-1:4242").beat()
    Heartbeat([], worker="web-2:4343").stopped()
    from django_platformkit.models import WorkerHeartbeat

    WorkerHeartbeat.objects.filter(worker="web-2:4343").update(last_seen=timezone.now() - datetime.timedelta(hours=1))
    task = OutboxEvent.objects.create(
        name="platformkit.task_default",
        payload={"task": "shop.tasks.send_receipt", "args": [7], "kwargs": {}, "backend": "default"},
    )
    return {"dead_letter": DeadLetter.objects.get(), "event": failed, "task": task.pk}


# Values of the scene (and of the test settings) that the pages show as data.
SCENE_DATA = ["KeyError: 'sku'", "Traceback ...", "default", "UTC", "shop.tasks.send_receipt"]


@pytest.mark.django_db(transaction=True)
def test_the_overview_shows_no_word_of_ours_that_did_not_go_through_gettext(client, operator, scene):
    from django_platformkit.jobs.controls import disable, request_run
    from django_platformkit.operate.pause import pause

    pause(["testapp.slow"], actor="olga", reason="the card processor is down")
    disable(["platformkit.outbox_purge"], actor="olga", reason="the big migration")
    request_run(["testapp.sync_prices"], actor="olga", reason="prices changed")
    client.force_login(operator)
    with marked():
        html = client.get(reverse("admin:django_platformkit_overview")).content.decode()
    assert "⟪failing⟫" in html and "⟪overdue⟫" in html and "⟪Subscriptions⟫" in html
    assert "⟪paused⟫" in html and "⟪disabled⟫" in html
    assert "⟪%(age)s ago⟫" not in html and re.search(r"⟪\d+ min( \d+ s)?⟫", html), "ages are translated whole"
    # Broker notes are the broker's own messages (data), as NATS said them.
    broker_notes = re.findall(r'pk-broker-note" title="([^"]*)"', html)
    controls = ["olga", "the card processor is down", "the big migration"]
    assert unmarked_words(html, SCENE_DATA + broker_notes + controls) == []


#: Every page of ours: the lists, the change pages, the replay confirmation.
PAGES = [
    "outboxevent",
    "handledevent",
    "attempt",
    "deadletter",
    "jobstate",
    "outboxtask",
    "deadletter-change",
    "outboxevent-change",
    "outboxtask-change",
    "deadletter-replay",
]


def page_url(page: str, scene: dict[str, object]) -> str:
    """The URL of one of ``PAGES``, or of "overview", showing ``scene``."""
    model, _, view = page.partition("-")
    if page == "overview":
        return reverse("admin:django_platformkit_overview")
    if view == "change":
        pk = {"deadletter": scene["dead_letter"].pk, "outboxevent": scene["event"], "outboxtask": scene["task"]}[model]
        return reverse(f"admin:django_platformkit_{model}_change", args=[pk])
    if view == "replay":
        return reverse("admin:django_platformkit_deadletter_replay", args=[scene["dead_letter"].pk])  # type: ignore[attr-defined]
    return reverse(f"admin:django_platformkit_{model}_changelist")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("page", PAGES)
def test_every_list_and_page_shows_no_word_of_ours_that_did_not_go_through_gettext(client, operator, scene, page):
    url = page_url(page, scene)
    client.force_login(operator)
    with marked():
        response = client.get(url)
    assert response.status_code == 200
    data = SCENE_DATA + [str(scene["event"]), "order", "sku", "n"]  # payload keys
    # The list's filters show the values of a field (subscription names) and Django's own words.
    assert unmarked_words(response.content.decode(), data) == []


def _untranslated_template(path: Path) -> str:
    """The template as a reader's text would come out of it: every tag and
    variable, and all of a {% blocktranslate %} or {% comment %} block, in
    place as "§" (its lines kept, so line numbers still hold)."""
    out, inside = [], None  # the block whose text is translated or ignored
    for token in Lexer(path.read_text()).tokenize():
        bits = token.contents.split() if token.token_type == TokenType.BLOCK else []
        word = bits[0] if bits else ""
        if word in ("blocktranslate", "blocktrans", "comment") or bits == ["block", "bodyclass"]:
            inside = word  # translated, a comment, or CSS class names
        if token.token_type == TokenType.TEXT and inside is None:
            out.append(token.contents)
        else:
            out.append("§" + "\n" * token.contents.count("\n"))
        if word in ("endblocktranslate", "endblocktrans", "endcomment") or (inside == "block" and word == "endblock"):
            inside = None
    return "".join(out)


def test_every_text_in_the_consoles_templates_is_inside_a_translate_tag():
    found = []
    for path in sorted(TEMPLATES.rglob("*.html")):
        text = _untranslated_template(path)
        text = re.sub(r"<style>.*?</style>", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
        said = r'(?:title|aria-label|placeholder)="([^"]*)"|type="submit"[^>]*value="([^"]*)"'
        for match in re.finditer(rf"{said}|<[^>]*>|([^<]+)", text):
            words = re.findall(r"[A-Za-z]{2,}", re.sub(r"&\w+;", " ", "".join(g or "" for g in match.groups())))
            if words:
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(PACKAGE)}:{line}: {' '.join(words)}")
    assert found == [], "text outside {% translate %}:\n" + "\n".join(found)


def _gettext_call(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", "") in {
        "_",
        "gettext",
        "gettext_lazy",
        "ngettext",
        "pgettext",
        "pgettext_lazy",
        "format_html",
    }


def _words(node: ast.AST | None) -> bool:
    """A literal a reader would see: a str with a word in it, or an f-string."""
    if isinstance(node, ast.JoinedStr):
        return True
    return (
        isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(re.search(r"[A-Za-z]{2}", node.value))
    )


def test_every_label_filter_title_choice_and_message_of_the_admin_goes_through_gettext():
    found = []
    for path in sorted((PACKAGE / "admin").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            # @admin.display(description=...) / @admin.action(description=...)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("display", "action"):
                for keyword in node.keywords:
                    if keyword.arg == "description" and not _gettext_call(keyword.value):
                        found.append(f"{where}: description={ast.unparse(keyword.value)}")
            # class attributes: a filter's title, a list's search help
            if (
                isinstance(node, ast.Assign)
                and any(getattr(t, "id", "") in ("title", "search_help_text") for t in node.targets)
                and not _gettext_call(node.value)
            ):
                found.append(f"{where}: {ast.unparse(node)}")
            # self.message_user(request, <text>, ...)
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "message_user"
                and len(node.args) > 1
                and _words(node.args[1])
            ):
                found.append(f"{where}: message_user({ast.unparse(node.args[1])})")
            # a filter's choices: return [("value", "label"), ...]
            if isinstance(node, ast.FunctionDef) and node.name == "lookups":
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Tuple) and len(inner.elts) == 2 and _words(inner.elts[1]):
                        found.append(f"{where}: lookups {ast.unparse(inner)}")
            # what a column or a field shows: return "words" from a display method
            if isinstance(node, ast.FunctionDef) and any(
                getattr(getattr(d, "func", None), "attr", "") == "display" for d in node.decorator_list
            ):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Return) and _words(inner.value):
                        found.append(f"{where}: {node.name} returns {ast.unparse(inner.value)}")
    assert found == [], "user-facing text not through gettext:\n" + "\n".join(found)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("language", LANGUAGES)
def test_every_page_of_the_console_has_every_string_translated(client, operator, scene, language):
    """The overview, every list, change page and the replay confirmation,
    rendered in ``language`` with something on each: a string of ours (or
    Django's) with no translation in the catalogues shows up marked."""
    client.force_login(operator)
    missing: dict[str, list[str]] = {}
    for page in ["overview", *PAGES]:
        with untranslated_marked(language) as active:
            response = client.get(page_url(page, scene))
        assert response.status_code == 200, page
        assert f'lang="{language}"' in response.content.decode(), f"{page} did not render in {language}"
        if ours := sorted(active.missing - djangos_own_strings()):
            missing[page] = ours
    assert missing == {}, f"strings with no {language} translation (run .ci/messages, then translate): {missing}"


@pytest.mark.unit
def test_a_string_without_a_translation_is_caught_by_the_render_test():
    """The marking above is not vacuous: a string no catalogue has comes back
    marked, one ours has comes back translated, Django's own words too."""
    with untranslated_marked("de") as active:
        assert translation.gettext("A sentence nobody translated") == "⟪A sentence nobody translated⟫"
        assert active.missing - djangos_own_strings() == {"A sentence nobody translated"}
        assert translation.gettext("Dead letters") == "Unzustellbare Nachrichten"
        assert translation.pgettext("cancel the selected events", "Cancel %(count)s") == "%(count)s stornieren"
        assert translation.ngettext("%(n)s ok", "%(n)s ok", 2) == "%(n)s ok"
        assert translation.gettext("Home") == "Start"


def _gettext_tools() -> None:
    missing = [tool for tool in ("xgettext", "msgmerge", "msgfmt", "msgattrib") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"GNU gettext is not installed ({', '.join(missing)} missing): apt-get install gettext")


@pytest.mark.process
@pytest.mark.unit
def test_the_catalogues_regenerated_from_the_code_have_nothing_left_to_translate(tmp_path):
    """makemessages over a copy of the package: a string marked in the code
    and absent from a catalogue comes back new (untranslated), a changed one
    fuzzy. Either means: run .ci/messages and translate."""
    _gettext_tools()
    copy = tmp_path / "django_platformkit"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.mo"))
    command = [sys.executable, "-m", "django", "makemessages", "--ignore", "migrations/*", "--add-location", "file"]
    command += [arg for language in LANGUAGES for arg in ("--locale", language)]
    # Django's own command, as .ci/messages runs it: no settings (this suite's aren't importable there).
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    made = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    left = {}
    for language in LANGUAGES:
        po = copy / "locale" / language / "LC_MESSAGES" / "django.po"
        entries = []
        for which in ("--untranslated", "--only-fuzzy"):
            out = subprocess.run(["msgattrib", which, "--no-wrap", str(po)], check=True, capture_output=True, text=True)
            entries += [f"{which[2:]}: {m}" for m in re.findall(r'^msgid "(.+)"$', out.stdout, re.M)]
        if entries:
            left[language] = entries
    assert left == {}, f"run .ci/messages and translate: {left}"


@pytest.mark.process
@pytest.mark.unit
@pytest.mark.parametrize("language", LANGUAGES)
def test_each_shipped_mo_is_its_po_compiled(tmp_path, language):
    _gettext_tools()
    folder = PACKAGE / "locale" / language / "LC_MESSAGES"
    compiled = tmp_path / "django.mo"
    subprocess.run(["msgfmt", "--check", "-o", str(compiled), str(folder / "django.po")], check=True)

    def catalogue(path: Path) -> dict[object, str]:
        with path.open("rb") as fp:
            return dict(gettext_module.GNUTranslations(fp)._catalog)  # type: ignore[attr-defined]

    shipped = catalogue(folder / "django.mo")
    assert len(shipped) > 200, "the shipped catalogue is (nearly) empty"
    assert shipped == catalogue(compiled), f"{folder / 'django.mo'} is stale: run .ci/messages"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("verb", ["pause", "resume", "disable_jobs", "run_now"])
def test_the_operator_controls_pages_show_no_word_of_ours_that_did_not_go_through_gettext(
    client, operator, scene, verb
):
    from django_platformkit.operate.pause import pause

    client.force_login(operator)
    if verb == "resume":
        pause(["testapp.flaky"], actor="olga", reason="the card processor is down")
    with marked():
        if verb in ("pause", "resume"):
            url = reverse(f"admin:django_platformkit_overview_{verb}")
            response = client.get(url, {"subscription": "testapp.flaky"})
        else:
            url = reverse("admin:django_platformkit_jobstate_changelist")
            response = client.post(url, {"action": verb, "_selected_action": ["testapp.sync_prices"], "index": "0"})
    assert response.status_code == 200
    data = SCENE_DATA + ["testapp.flaky", "olga", "the card processor is down", "testapp.sync_prices"]
    assert unmarked_words(response.content.decode(), data) == []
    # ... and in every language the console ships, with every string of ours translated.
    for language in LANGUAGES:
        with untranslated_marked(language) as active:
            if verb in ("pause", "resume"):
                response = client.get(url, {"subscription": "testapp.flaky"})
            else:
                response = client.post(url, {"action": verb, "_selected_action": ["testapp.sync_prices"], "index": "0"})
        assert response.status_code == 200
        assert sorted(active.missing - djangos_own_strings()) == [], f"{verb} in {language}: run .ci/messages"
