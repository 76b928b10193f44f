"""The package's layout holds: subpackages by concept that meet through their ``__init__``.

- A module of one subpackage imports another subpackage through its ``__init__`` (its
  public names) or from ``jaxamp/_utils/``, never from that subpackage's private modules.
  The top-level public namespaces ``jaxamp.compat`` and ``jaxamp.nnx`` each re-export
  from the one subpackage that implements them, as ``jaxamp/_train_state.py`` does for
  ``jaxamp.TrainState`` (served on first use: it imports Flax).
- Each subpackage's ``__init__`` is a one-line docstring saying what the concept is, and
  re-exports.
- No module is over 400 lines.
"""

import ast
import pathlib

import jaxamp

ROOT = pathlib.Path(jaxamp.__file__).parent
SUBPACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
FACADES = {"compat.py": "loss_scale", "nnx.py": "skip", "_train_state.py": "skip"}


def _imported_modules(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxamp"):
            out.append(node.module)
            out.extend(f"{node.module}.{a.name}" for a in node.names)
    return out


def _private_part(module: str) -> tuple[str, str] | None:
    """``(subpackage, private module)`` for ``jaxamp.<sub>._<mod>...``, else None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in SUBPACKAGES and parts[2].startswith("_"):
        return parts[1], parts[2]
    return None


def test_the_subpackages_are_the_concepts():
    assert SUBPACKAGES == ["_utils", "casting", "checkpoint", "loss_scale", "skip"]


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
                continue  # jaxamp.compat / jaxamp.nnx: the public namespace of one subpackage
            crossing.append(f"{rel} imports {module}")
    assert not crossing, "\n".join(sorted(set(crossing)))


def test_each_subpackage_init_is_a_docstring_line_and_reexports():
    for name in SUBPACKAGES:
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
