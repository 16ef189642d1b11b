"""The documentation says what the code does: docs/cli.md holds every command's --help as the
code prints it, the help's defaults are the code's, every relative link of README.md, CHANGELOG.md
and docs/ reaches a file and a heading, and the README's example runs as written."""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import click
import psycopg

from replicator.cli import NEW_QUEUE_DEFAULTS, cli
from replicator.source import Source, format_duration, parse_duration

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "replicator"
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        found[f"{prefix}{name}"] = command
        if isinstance(command, click.Group):
            found.update(_commands(command, f"{prefix}{name} "))
    return found


def _option(path: str, name: str) -> click.Option:
    (option,) = [p for p in _commands(cli)[path].params if isinstance(p, click.Option) and name in p.opts]
    return option


def test_cli_reference_is_every_commands_help_as_the_code_prints_it():
    # cog reruns docs/cli.md's blocks (each command's --help; the last one fails when a command has none)
    # and fails when the file would change. Run from the checkout, so that it reads this code.
    result = subprocess.run([sys.executable, "-m", "cogapp", "--check", "--diff", "docs/cli.md"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (f"docs/cli.md differs from the commands' --help: run `cog -r docs/cli.md`\n"
                                    f"{result.stdout}{result.stderr}")


def test_every_command_shows_an_example():
    missing = [path for path, command in _commands(cli).items()
               if not isinstance(command, click.Group) and "Example:" not in (command.help or "")]
    assert not missing, f"commands whose --help shows no example: {missing}"


def test_queue_create_shows_the_settings_a_queue_gets_without_them(source: Source):
    # `queue create` passes the defaults it shows; a queue created in SQL gets its columns' defaults
    source.create_queue("made_in_sql")
    made_in_sql = source.queue_config("made_in_sql")
    for name, default in NEW_QUEUE_DEFAULTS.items():
        expected = parse_duration(default) if isinstance(default, str) else default
        assert made_in_sql[name] == expected, name
        assert _option("queue create", f"--{name.replace('_', '-')}").show_default is True
    assert made_in_sql["rotation_period"] == parse_duration(_option("queue create", "--rotation-period").default)
    assert made_in_sql["ntables"] == _option("queue create", "--tables").default


def test_delta_help_states_the_maintenance_constants():
    from replicator.targets import VACUUM_EVERY_MIN
    from replicator.targets.delta import maintenance

    assert f"past {maintenance.PURGE_RATIO:.0%}" in (_option("delta optimize", "--purge").help or "")
    retention = format_duration(timedelta(seconds=maintenance.RETENTION_SECONDS))
    assert f"({retention} unless set)" in (_option("delta vacuum", "--retain").help or "")
    floor = format_duration(timedelta(seconds=maintenance.MIN_RETENTION))
    assert f"(at least {floor})" in (_option("delta vacuum", "--force").help or "")
    every = format_duration(timedelta(seconds=VACUUM_EVERY_MIN))
    assert f"at least {every}" in (_option("consume", "--vacuum-every").help or "")
    orphans = maintenance.ORPHAN_SECONDS / 86400
    assert f"the table's retention and {orphans:g} days" in " ".join((_commands(cli)["delta vacuum"].help or "").split())


def _fenced(lines: list[str]) -> list[bool]:
    """Whether each line is inside (or fences) a code block."""
    inside, marks = False, []
    for line in lines:
        fence = line.lstrip().startswith("```")
        marks.append(inside or fence)
        inside = inside != fence
    return marks


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    lines = page.read_text().splitlines()
    anchors: set[str] = set()
    for line, fenced in zip(lines, _fenced(lines)):
        heading = re.match(r"#{1,6} (.*)", line)
        if fenced or not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading[1]).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def _links(page: Path) -> list[str]:
    lines = page.read_text().splitlines()
    text = "\n".join(re.sub(r"`[^`]*`", "", line) for line, fenced in zip(lines, _fenced(lines)) if not fenced)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_reaches_a_file_and_a_heading():
    broken = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"[a-z]+:", link):
                continue   # https:, mailto:
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}: no such file")
            elif anchor and (target.suffix != ".md" or anchor not in _anchors(target)):
                broken.append(f"{page.relative_to(ROOT)}: {link}: no such heading")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move reference into docs/"
    # a fresh machine's two commands come first, as .ci/run and tests/test_demo.py rely on
    first_block = lines[lines.index("```") + 1:lines.index("```", lines.index("```") + 1)]
    assert [line.split()[0] for line in first_block] == ["bin/demo", "bin/test"]


def _example() -> list[str]:
    """The README's example: the first code block after its heading "An example"."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```sh", lines.index("## An example")) + 1
    return lines[start:lines.index("```", start)]


def test_the_readme_example_runs_as_written(empty_dsn, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")} | {"REPLICATOR_DSN": empty_dsn}
    output: list[str] = []
    checked = 0
    for line in _example():
        words = shlex.split(line, comments=True)
        if words[0] == "export":
            assert words[1].startswith("REPLICATOR_DSN="), line   # the test's database stands in for it
        elif words[0] == "psql":
            assert words[2] == "-c", line
            with psycopg.connect(empty_dsn, autocommit=True) as conn:
                conn.execute(words[3])
        elif words[0] == "replicator":
            result = subprocess.run([str(SCRIPT), *words[1:]], cwd=tmp_path, env=env, capture_output=True,
                                    text=True, timeout=120)
            assert result.returncode == 0, f"{line}\n{result.stderr}"
        elif words[0] == "sqlite3":
            with sqlite3.connect(tmp_path / words[1]) as replica:
                output = ["|".join(map(str, row)) for row in replica.execute(words[2])]
        else:   # what the command before printed
            assert output.pop(0) == line
            checked += 1
    assert checked and not output
