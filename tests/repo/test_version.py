"""The version is in one place (``jaxamp.__version__``) and true: the package metadata
reads it, and it is the CHANGELOG's newest release."""

import pathlib
import re
import tomllib

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pyproject_reads_the_version_from_jaxamp():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jaxamp.__version__"}


def test_the_version_is_the_changelogs_newest():
    newest = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest is not None
    assert jaxamp.__version__ == newest.group(1)
