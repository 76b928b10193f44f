"""The package's layout holds: subpackages by concept that meet through their ``__init__``.

- A module of one subpackage imports another subpackage through its ``__init__`` (its
  public names) or from ``jaxamp/_utils/``, never from that subpackage's private modules.
  The top-level public namespace ``jaxamp.nnx`` re-exports from the one subpackage
  that implements it, as ``jaxamp/_train_state.py`` does for ``jaxamp.TrainState``
  (served on first use: it imports Flax); ``jaxamp.compat`` is a subpackage of its own.
- Each subpackage's ``__init__`` is a one-line docstring saying what the concept is, and
  re-exports.
- ``casting/`` is cut into rooms, one concept each, in a declared order
  (``CASTING_ROOMS``): a module imports only from its own room or an earlier one (run-time,
  ``TYPE_CHECKING`` and function-level imports alike), so the rooms stack without cycles and
  a maintainer reads them bottom up; no casting module is in an import cycle, not even
  a type-only one. Each room's ``__init__`` is its one-line docstring.
- No module is over 400 lines.
- ``tests/`` mirrors the package (tests/README.md): ``tests/<sub>/test_<module>.py`` (or
  ``test_<module>_<topic>.py``) for a module anywhere in ``jaxamp/<sub>/``, the other test
  folders are the suites listed, ``behaviour/``'s files the topics listed.
"""

import ast
import pathlib

import jaxamp

ROOT = pathlib.Path(jaxamp.__file__).parent
SUBPACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
FACADES = {"nnx.py": "skip", "_train_state.py": "skip"}
# casting's rooms, lowest first: what dtype each op takes; FP8 products; the jaxpr
# interpreter; the autocast front end; the three tools that run autocast's program
# (choosing the FP8 modules, finding an overflow, auditing what ran).
CASTING_ROOMS = (
    "_rules", "_fp8", "_interpreter", "_autocast", "_fp8_select", "_find_overflow", "_audit",
)  # fmt: skip


def _imported_modules(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxamp"):
            out.append(node.module)
            out.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names if a.name.startswith("jaxamp"))
    return out


def _private_part(module: str) -> tuple[str, str] | None:
    """``(subpackage, private module)`` for ``jaxamp.<sub>._<mod>...``, else None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in SUBPACKAGES and parts[2].startswith("_"):
        return parts[1], parts[2]
    return None


def test_the_subpackages_are_the_concepts():
    assert SUBPACKAGES == [
        "_utils",
        "casting",
        "checkpoint",
        "compat",
        "loss_scale",
        "low_precision_state",
        "skip",
    ]


def test_subpackages_meet_through_their_init_or_utils():
    crossing = []
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        home = rel.parts[0] if len(rel.parts) > 1 else None
        for module in _imported_modules(f):
            hit = _private_part(module)
            if hit is None or hit[0] in (home, "_utils"):
                continue
            if home is None and FACADES.get(rel.name) == hit[0]:
                continue  # jaxamp.nnx: the public namespace of one subpackage
            crossing.append(f"{rel} imports {module}")
    assert not crossing, "\n".join(sorted(set(crossing)))


def test_each_subpackage_init_is_a_docstring_line_and_reexports():
    rooms = [f"casting/{room}" for room in CASTING_ROOMS]
    for name in SUBPACKAGES + rooms:
        tree = ast.parse((ROOT / name / "__init__.py").read_text())
        doc = ast.get_docstring(tree)
        assert doc and "\n" not in doc.strip(), f"{name}/__init__.py: one docstring line"
        body = tree.body[1:]
        allowed = (ast.ImportFrom, ast.Assign)
        assert all(isinstance(n, allowed) for n in body), f"{name}/__init__.py: re-exports only"
        for n in body:
            if isinstance(n, ast.Assign):
                assert [t.id for t in n.targets] == ["__all__"], f"{name}/__init__.py"


def test_no_module_is_over_400_lines():
    long = {
        str(f.relative_to(ROOT)): n
        for f in ROOT.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > 400
    }
    assert not long, long


def _room(module: str) -> str | None:
    """The casting room of ``jaxamp.casting.<room>...``; None outside casting or for its
    ``__init__`` (``jaxamp.casting`` itself, which re-exports from the rooms)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["jaxamp", "casting"] and len(parts) > 2 else None


def test_casting_is_its_rooms():
    casting = ROOT / "casting"
    folders = sorted(p.name for p in casting.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(CASTING_ROOMS), "a new casting folder takes its place in CASTING_ROOMS"
    loose = sorted(p.name for p in casting.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"each casting module lives in a room: {loose}"
    assert all((casting / room / "__init__.py").is_file() for room in CASTING_ROOMS)


def test_casting_rooms_import_only_their_own_or_earlier_rooms():
    order = {room: i for i, room in enumerate(CASTING_ROOMS)}
    upward = []
    for f in (ROOT / "casting").rglob("*.py"):
        home = _room("jaxamp." + ".".join(f.relative_to(ROOT).with_suffix("").parts))
        if home is None or home == "__init__":
            continue
        for module in _imported_modules(f):
            there = _room(module)
            if there in order and order[there] > order[home]:
                upward.append(f"{f.relative_to(ROOT)} ({home}) imports {module} ({there})")
    assert not upward, "\n".join(sorted(set(upward)))


def test_casting_modules_import_no_cycle():
    """Within a room too the modules stack: no import cycle, not even a type-only one."""
    casting = ROOT / "casting"
    names = {
        "jaxamp." + ".".join(f.relative_to(ROOT).with_suffix("").parts): f
        for f in casting.rglob("_*.py")
        if f.name != "__init__.py"
    }
    deps = {
        name: {
            m if m in names else m.rpartition(".")[0]
            for m in _imported_modules(f)
            if m in names or m.rpartition(".")[0] in names
        }
        - {name}
        for name, f in names.items()
    }
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in sorted(deps[name]):
            if state.get(dep) == 1:
                return [*path, name, dep]
            if dep not in state and (found := cycle_from(dep, [*path, name])):
                return found
        state[name] = 2
        return None

    for name in sorted(names):
        if name not in state:
            found = cycle_from(name, [])
            assert found is None, " -> ".join(found)


TESTS = pathlib.Path(__file__).parents[1]
# tests/<folder> -> the subpackage it mirrors (tests/README.md).
MIRRORS = {sub.lstrip("_"): sub for sub in SUBPACKAGES}
# Folders of suites across modules, each documented in tests/README.md.
SUITES = {"behaviour", "repo", "conformance", "matrix", "multidevice", "multiprocess"}
# behaviour/'s topics: what must hold whatever module implements it.
BEHAVIOUR_TOPICS = {
    "test_fault_injection",
    "test_first_hour_errors",
    "test_layout",
    "test_no_bad_update",
    "test_public_api",
    "test_recipes_api",
    "test_reflexes",
    "test_state_arguments",
    "test_state_paths",
}


def _names(package: pathlib.Path) -> set[str]:
    """The module and package names under `package`, any depth, leading ``_`` dropped."""
    mods = {f.stem for f in package.rglob("*.py") if f.name != "__init__.py"}
    pkgs = {p.parent.name for p in package.rglob("__init__.py")}
    return {n.lstrip("_") for n in mods | pkgs}


def _names_one(name: str, names: set[str]) -> bool:
    """``test_<name>`` or ``test_<name>_<topic>`` for a name in `names`."""
    stem = name.removeprefix("test_")
    return any(stem == n or stem.startswith(n + "_") for n in names)


def test_tests_mirror_the_package():
    """tests/<sub>/test_<module>[_<topic>].py tests jaxamp/<sub>/**/_<module>.py (a room or
    the subpackage itself standing for a module); the other folders are the suites listed."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.rglob("test_*.py"))}
    assert folders == set(MIRRORS) | SUITES, "a new test folder mirrors a subpackage or is a suite"
    wrong = []
    for folder, sub in MIRRORS.items():
        names = _names(ROOT / sub)
        files = (TESTS / folder).rglob("test_*.py")
        wrong += [str(f.relative_to(TESTS)) for f in files if not _names_one(f.stem, names)]
    top = {f.stem for f in ROOT.glob("*.py") if f.name != "__init__.py"}
    wrong += [f.name for f in TESTS.glob("test_*.py") if not _names_one(f.stem, top)]
    assert not wrong, f"name the module each tests: {wrong}"
    behaviour = {f.stem for f in (TESTS / "behaviour").glob("test_*.py")}
    assert behaviour == BEHAVIOUR_TOPICS, "a behaviour topic is listed here and in tests/README.md"


def test_module_names_are_unique_within_a_subpackage():
    """What lets tests/<sub>/ be flat: a module name says which module of the subpackage."""
    for sub in SUBPACKAGES:
        stems = [f.stem for f in (ROOT / sub).rglob("*.py") if f.name != "__init__.py"]
        assert len(stems) == len(set(stems)), sub
