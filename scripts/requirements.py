"""Prints, one a line, what scripts/setup.sh installs from pyproject.toml: the build requirements,
the dependencies and the `examples` and `test` extras (this package's own extras, e.g.
fp8amp[examples], are left out: their lists are printed themselves). Given extras' names, those
extras instead of examples and test; after `--only`, those extras alone."""

import pathlib
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

project_file = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
meta = tomllib.loads(project_file.read_text())
name = meta["project"]["name"]
extras = meta["project"].get("optional-dependencies", {})
only = sys.argv[1:2] == ["--only"]
names = sys.argv[2:] if only else sys.argv[1:]
wanted = [] if only else meta["build-system"]["requires"] + meta["project"]["dependencies"]
for extra in names or ["examples", "test"]:
    wanted += extras.get(extra, [])
for requirement in dict.fromkeys(wanted):
    if not requirement.replace(" ", "").startswith(name + "["):
        print(requirement)
