"""What a packager ships: one version, printed by `replicator --version` and named in the
changelog; the MIT licence; and a reviewed licence for every runtime dependency
(docs/licensing.md), so that no dependency, direct or indirect, arrives unreviewed."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import replicator

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "replicator"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_prints_the_packages_version():
    result = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"replicator, version {replicator.__version__}\n"
    Version(replicator.__version__)   # a version pip and packagers read (PEP 440)


def test_the_package_metadata_takes_its_version_from_the_code():
    assert "version" not in PYPROJECT["project"]
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "replicator.__version__"}


def test_the_changelog_has_a_section_for_this_version():
    version = Version(replicator.__version__)
    headings = re.findall(r"^## (\S+) — (.*)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings, "CHANGELOG.md has no version sections"
    newest, when = headings[0]
    assert newest == version.base_version, f"CHANGELOG.md's newest section is {newest}, the code {version}"
    # a development version's section is unreleased; a release's is dated
    assert (when == "unreleased") == version.is_devrelease, when


def test_the_licence_is_mit_as_the_metadata_says():
    assert PYPROJECT["project"]["license"] == "MIT"
    assert "LICENSE" in PYPROJECT["project"]["license-files"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n") and "Copyright (c) 2026 the replicator authors" in text


def _stated_licence(dist: importlib.metadata.Distribution) -> str:
    """A package's licence as its metadata states it: the SPDX License-Expression, else its
    licence classifiers, else the first line of its License field (some hold the whole text)."""
    metadata = dist.metadata
    if metadata.get("License-Expression"):
        return metadata["License-Expression"]
    classifiers = [c.split(" :: ")[-1] for c in metadata.get_all("Classifier") or [] if c.startswith("License :: ")]
    if classifiers:
        return "; ".join(classifiers)
    return (metadata.get("License") or "").strip().partition("\n")[0]


def _runtime_dependencies() -> dict[str, tuple[str, str]]:
    """Every package replicator needs at run time, with each extra but the development tools',
    direct and indirect, as installed here: name -> (what pulls it in, its stated licence)."""
    project = PYPROJECT["project"]
    todo = [(Requirement(r), "replicator") for r in project["dependencies"]]
    todo += [(Requirement(r), f"replicator[{extra}]")
             for extra, requirements in project["optional-dependencies"].items() if extra != "dev"
             for r in requirements]
    found: dict[str, tuple[str, str]] = {}
    while todo:
        requirement, by = todo.pop(0)
        name = canonicalize_name(requirement.name)
        if name in found or name == "replicator":   # an extra naming another (spark: replicator[delta]), listed above
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise AssertionError(f"{name} ({by}) is not installed: install replicator with every extra but dev "
                                 f"to review its licence") from None
        found[name] = (by, _stated_licence(dist))
        for text in dist.requires or []:
            needed = Requirement(text)
            if needed.marker is None or any(needed.marker.evaluate({"extra": e}) for e in ["", *requirement.extras]):
                todo.append((needed, name))
    return found


def _reviewed() -> dict[str, str]:
    """docs/licensing.md's table: package -> the licence its metadata stated when reviewed."""
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| `([^`]+)` \|", (ROOT / "docs" / "licensing.md").read_text(),
                      re.MULTILINE)
    return {canonicalize_name(name): licence for name, licence in rows}


def test_every_runtime_dependency_is_reviewed_with_the_licence_it_states():
    installed, reviewed = _runtime_dependencies(), _reviewed()
    problems = [f"{name} ({by}, {licence}): not in docs/licensing.md" for name, (by, licence) in installed.items()
                if name not in reviewed]
    problems += [f"{name}: docs/licensing.md says {reviewed[name]!r}, its metadata {licence!r}"
                 for name, (_, licence) in installed.items() if name in reviewed and reviewed[name] != licence]
    problems += [f"{name}: in docs/licensing.md but no longer a dependency" for name in reviewed.keys() - installed.keys()]
    assert not problems, "review the licences:\n" + "\n".join(problems)
