"""The tutorial (``docs/tutorial/*.md``), executed: its own code blocks, in
reading order, in a fresh Django project in a temporary directory, against
the suite's PostgreSQL (a database of its own) and NATS (a stream and subject
prefix of its own). A changed API breaks this test, not the reader.

Every fenced block of a tutorial page follows a marker comment (an HTML
comment, invisible on the site) that says what to do with it:

    <!-- tutorial: write -->                 write the block to the file its title="..." names
    <!-- tutorial: append -->                append it to that file
    <!-- tutorial: run -->                   run it with bash in the project; it must exit 0
    <!-- tutorial: run, expect "TEXT" -->    ... and print TEXT (stdout or stderr; repeatable)
    <!-- tutorial: run-until "TEXT" -->      start it, wait for TEXT, press Ctrl-C: it must exit 0
    <!-- tutorial: output -->                exactly what the run before it printed on stdout
    <!-- tutorial: skip -->                  not executed: installing, servers, interactive steps

A block without a marker fails the test, so nobody adds one by accident that
is never run. The package comes from this venv (the tutorial's install step
is a skip); ``python`` and ``django-admin`` resolve to it through PATH.
"""

from __future__ import annotations

import asyncio
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import django
import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial"

#: What the tutorial names its broker namespace; the test gives itself its own.
TUTORIAL_STREAM = '"STREAM": "TUTORIAL"'
TUTORIAL_PREFIX = '"SUBJECT_PREFIX": "tutorial"'

#: Django 6's `shell` announces its automatic imports on stdout first; not the tutorial's output.
SHELL_NOTICE = re.compile(r"^\d+ objects? imported automatically")
MARKER = re.compile(r"^<!--\s*tutorial:\s*(?P<spec>.*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+)(?P<info>.*)$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
ACTIONS = ("write", "append", "run", "run-until", "output", "skip")

pytestmark = pytest.mark.skipif(
    django.VERSION < (6, 0), reason="the tutorial's third part runs a django.tasks task: Django 6.0 or later"
)


@dataclass
class Block:
    page: str
    line: int
    action: str
    texts: list[str] = field(default_factory=list)  # expect "..." / run-until "..."
    title: str | None = None
    code: str = ""

    @property
    def where(self) -> str:
        return f"docs/tutorial/{self.page}:{self.line}"


def tutorial_pages() -> list[Path]:
    """The pages in reading order: their names start with their number."""
    pages = sorted(TUTORIAL.glob("*.md"))
    unnumbered = [p.name for p in pages if not p.name[0].isdigit()]
    assert not unnumbered, f"tutorial pages must start with their number (reading order): {unnumbered}"
    return pages


def extract(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        assert marker, (
            f"docs/tutorial/{page.name}:{i + 1}: a code block without a '<!-- tutorial: ... -->' marker "
            f"on the line before it (one of {', '.join(ACTIONS)}; see tests/test_tutorial.py)"
        )
        spec = marker["spec"]
        action = spec.split(None, 1)[0].rstrip(",")
        assert action in ACTIONS, f"docs/tutorial/{page.name}:{i + 1}: unknown tutorial action {action!r}"
        title = TITLE.search(opening["info"])
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        block = Block(
            page.name,
            i - len(body),
            action,
            texts=re.findall(r'"([^"]*)"', spec),
            title=title["title"] if title else None,
            code="\n".join(body) + "\n",
        )
        if action in ("write", "append"):
            assert block.title, f'{block.where}: a {action} block needs title="path" on its fence'
        if action == "run-until":
            assert block.texts, f'{block.where}: run-until needs the text to wait for: run-until "TEXT"'
        blocks.append(block)
        i += 1
    return blocks


@pytest.mark.unit
def test_every_tutorial_page_marks_its_blocks_and_the_tutorial_runs_things():
    """Runs without servers: the markers parse and the tutorial is not all skips."""
    blocks = [b for page in tutorial_pages() for b in extract(page)]
    assert {b.action for b in blocks} >= {"write", "run", "run-until", "output"}


@pytest.mark.unit
def test_the_tutorial_says_that_djangos_shell_prints_a_line_its_outputs_leave_out():
    """The test drops the shell's "N objects imported automatically" line
    (``SHELL_NOTICE``) before comparing; a reader's terminal shows it above
    the output. The page of the first ``manage.py shell`` whose output is
    shown must say so, before the reader compares."""
    for page in tutorial_pages():
        blocks = extract(page)
        shown = [
            i
            for i, b in enumerate(blocks[:-1])
            if b.action == "run" and "manage.py shell" in b.code and blocks[i + 1].action == "output"
        ]
        if shown:
            text = page.read_text()
            assert "objects imported automatically" in text and "--no-imports" in text, (
                f"docs/tutorial/{page.name}: its first `manage.py shell` output leaves out Django's "
                "'N objects imported automatically' line without saying so"
            )
            return
    pytest.fail("no tutorial page shows the output of `manage.py shell`")


# --- the run ----------------------------------------------------------------------


def _database_env(database_url: str, name: str) -> dict[str, str]:
    """libpq's variables, which the tutorial's settings read (Django leaves
    HOST/PORT/USER/PASSWORD empty and libpq takes them from here)."""
    parts = urlsplit(database_url)
    return {
        "PGHOST": parts.hostname or "127.0.0.1",
        "PGPORT": str(parts.port or 5432),
        "PGUSER": unquote(parts.username or "postgres"),
        "PGPASSWORD": unquote(parts.password or ""),
        "PGDATABASE": name,
    }


def _admin(database_url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(statement)


def _delete_stream(nats_url: str, stream: str) -> None:
    async def delete() -> None:
        import nats

        nc = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            await nc.jetstream().delete_stream(stream)
        except Exception:
            pass  # never created (the run failed early): nothing to delete
        finally:
            await nc.close()

    asyncio.run(delete())


class Project:
    """The tutorial's project directory and the shell it runs commands in."""

    def __init__(self, path: Path, env: dict[str, str], replacements: dict[str, str]) -> None:
        self.path = path
        self.env = env
        self.replacements = replacements
        self.replaced: set[str] = set()
        self.last_stdout: str | None = None

    def write(self, block: Block, *, append: bool) -> None:
        code = block.code
        for old, new in self.replacements.items():
            if old in code:
                code = code.replace(old, new)
                self.replaced.add(old)
        target = self.path / block.title
        assert append or not target.exists() or target.suffix == ".py", f"{block.where}: overwrites {block.title}"
        if append:
            assert target.exists(), f"{block.where}: appends to {block.title}, which no step created"
            target.write_text(target.read_text() + "\n" + code)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(code)

    def run(self, block: Block) -> None:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block.code],
            cwd=self.path,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{block.code}\n{output}"
        for text in block.texts:
            assert text in output, f"{block.where}: the tutorial says this prints {text!r}; it printed:\n{output}"
        self.last_stdout = done.stdout

    def run_until(self, block: Block, timeout: float = 90.0) -> None:
        """Start the command, wait for the text, then Ctrl-C (SIGINT to its
        process group, as a terminal sends it): it must exit 0."""
        (text,) = block.texts
        proc = subprocess.Popen(
            ["bash", "-e", "-c", block.code],
            cwd=self.path,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        output: list[str] = []
        seen = False
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(proc.stdout, selectors.EVENT_READ)
                deadline = time.monotonic() + timeout
                while not seen and time.monotonic() < deadline:
                    if selector.select(timeout=0.5):
                        line = proc.stdout.readline()
                        if not line:  # exited before printing it
                            break
                        output.append(line)
                        seen = text in line
            assert seen, f"{block.where}: waited {timeout:.0f} s for {text!r}; it printed:\n{''.join(output)}"
            os.killpg(proc.pid, signal.SIGINT)
            rest, _ = proc.communicate(timeout=60)
            output.append(rest)
            assert proc.returncode == 0, f"{block.where}: exit {proc.returncode} after Ctrl-C\n{''.join(output)}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.last_stdout = None

    def compare_output(self, block: Block) -> None:
        assert self.last_stdout is not None, f"{block.where}: an output block must follow a run block"
        printed = [line for line in self.last_stdout.splitlines() if line.strip() and not SHELL_NOTICE.match(line)]
        shown = [line for line in block.code.splitlines() if line.strip()]
        assert [line.rstrip() for line in printed] == [line.rstrip() for line in shown], (
            f"{block.where}: the tutorial shows\n{block.code}but the command printed\n{self.last_stdout}"
        )
        self.last_stdout = None


OVERVIEW_CHECK = """
from django.contrib.auth.models import User
from django.test import Client

user = User.objects.create_superuser("tutorial-check", password="not-used")
client = Client(HTTP_HOST="localhost")
client.force_login(user)
page = client.get("/admin/django_platformkit/overview/")
print("STATUS", page.status_code)
print(page.content.decode())
"""


@pytest.mark.process
def test_the_tutorial_runs_from_an_empty_folder_to_a_replayed_dead_letter(platformkit_services, tmp_path):
    database_url, nats_url = platformkit_services
    token = uuid.uuid4().hex[:8]
    database, stream, prefix = f"tutorial_{token}", f"TUTORIAL_{token}", f"tutorial_{token}"
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "PLATFORMKIT_", "PG"))
        and key not in ("DATABASE_URL", "NATS_URL", "PYTHONPATH")
    }
    env.update(
        _database_env(database_url, database),
        NATS_URL=nats_url,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    project = Project(
        tmp_path / "shop-tutorial",
        env,
        {TUTORIAL_STREAM: f'"STREAM": "{stream}"', TUTORIAL_PREFIX: f'"SUBJECT_PREFIX": "{prefix}"'},
    )
    project.path.mkdir()
    _admin(database_url, f'CREATE DATABASE "{database}"')
    try:
        for page in tutorial_pages():
            for block in extract(page):
                if block.action == "skip":
                    continue
                if block.action in ("write", "append"):
                    project.write(block, append=block.action == "append")
                elif block.action == "run":
                    project.run(block)
                elif block.action == "run-until":
                    project.run_until(block)
                elif block.action == "output":
                    project.compare_output(block)
        assert project.replaced == set(project.replacements), (
            f"the tutorial no longer configures {sorted(set(project.replacements) - project.replaced)} "
            "literally: this test must give the run a broker namespace of its own"
        )
        # Part 5 says the overview page shows the subscriptions and the job.
        check = Block("(after the last page)", 0, "run", code=f"python manage.py shell -c '{OVERVIEW_CHECK}'\n")
        project.run(check)
        html = project.last_stdout
        assert "STATUS 200" in html, html
        for name in ("shop.send_confirmation", "shop.reserve_stock", "platformkit.task_default", "shop.report_sales"):
            assert name in html, f"the overview page does not show {name}"
        assert "data-worker=" in html, "the overview page shows no worker"
    finally:
        _delete_stream(nats_url, stream)
        _admin(database_url, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
