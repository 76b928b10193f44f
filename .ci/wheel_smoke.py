"""Smoke test of an installed wheel, run by `make wheel-smoke` in a fresh virtual
environment, from outside the repository (so `import jaxamp` is the wheel's).

Checks: the import resolves to site-packages, the version and the `py.typed`
marker are there, the README's quick start runs as written, and one example runs.
`make wheel-smoke` then uninstalls Flax and runs tests/utils/without_flax.py: the
optax path of the installed wheel without Flax.
"""

from __future__ import annotations

import pathlib
import re
import runpy
import sys

REPO = pathlib.Path(sys.argv[1]).resolve()

import jaxamp  # noqa: E402

where = pathlib.Path(jaxamp.__file__).resolve()
assert "site-packages" in where.parts, f"jaxamp imported from {where}, not the installed wheel"
assert where.parent != REPO / "jaxamp", f"{where} is the source tree, not the wheel"
assert (where.parent / "py.typed").is_file(), "the wheel lacks py.typed"
print(f"jaxamp {jaxamp.__version__} from {where.parent}")

readme = (REPO / "README.md").read_text()
start = readme.index("<!-- --8<-- [start:quickstart] -->")
end = readme.index("<!-- --8<-- [end:quickstart] -->")
blocks = re.findall(r"```python\n(.*?)```", readme[start:end], flags=re.S)
assert blocks, "no quick start in the README"
namespace: dict = {}
for i, code in enumerate(blocks):
    exec(compile(code, f"README.md[quick start block {i}]", "exec"), namespace)
assert int(namespace["m"]["skipped_steps"]) == 0
print("README quick start: ok")

runpy.run_path(str(REPO / "examples" / "quickstart.py"), run_name="__main__")
print("examples/quickstart.py: ok")
