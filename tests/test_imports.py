"""What importing a module pulls in: the router and the control plane import no torch and nothing of the engine
(each checked in a fresh interpreter, where no other test has imported anything yet); the root package
resolves its public names on first use; no test module imports another (shared code lives in helper modules).
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pdcluster
import pdcluster.control
import pdcluster.engine

TESTS = Path(__file__).resolve().parent
ENGINE_SIDE = ("torch", "numba", "pdcluster.engine", "pdcluster.kv_transfer", "pdcluster.node", "pdcluster.device")
CONTROL_MODULES = sorted(m.name for m in pkgutil.iter_modules(pdcluster.control.__path__, "pdcluster.control."))


def imported_by(module: str) -> list[str]:
    """The modules a fresh interpreter holds after `import module`."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def engine_side(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == name or m.startswith(name + ".") for name in ENGINE_SIDE)]


@pytest.mark.parametrize("module", ["pdcluster", "pdcluster.router.server", "pdcluster.router.app",
                                    "pdcluster.router.workers", *CONTROL_MODULES])
def test_router_and_control_plane_import_neither_torch_nor_the_engine(module):
    assert engine_side(imported_by(module)) == []


def test_the_pdcluster_command_imports_no_torch():
    """`pdcluster router` runs the router from the command line, which also declares the node commands' flags
    (the engine knobs of `EngineArgs`): that must not cost the router process torch."""
    modules = imported_by("pdcluster.cli.main")
    assert [m for m in modules if m.split(".")[0] in ("torch", "numba", "transformers")] == []


def test_every_public_name_resolves_and_is_then_a_plain_attribute():
    assert sorted(pdcluster.__all__) == sorted(set(pdcluster.__all__))
    for package in (pdcluster, pdcluster.engine):
        for name in package.__all__:
            value = getattr(package, name)
            assert value.__name__ == name
            assert vars(package)[name] is value   # kept: the next lookup does not go through __getattr__
            assert name in dir(package)
    assert pdcluster.LLM is pdcluster.engine.LLM


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        pdcluster.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        exec("from pdcluster.engine import NoSuchThing", {})


def test_the_type_checking_imports_name_what_the_lazy_table_resolves():
    """Type checkers and IDEs read the `if TYPE_CHECKING:` block of pdcluster/__init__.py; at run time the
    names come from the table. Both must say the same."""
    tree = ast.parse(Path(pdcluster.__file__).read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    declared = {alias.asname or alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert declared == {name: getattr(pdcluster, name).__module__ for name in pdcluster.__all__}


def test_no_test_module_imports_another():
    """Shared fixtures go to conftest.py, shared helpers to a helper module (node_helpers.py, router_helpers.py,
    ...): a test module imported by another runs its module-level code twice and ties the two files together."""
    offenders = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + ([alias.name for alias in node.names] if not node.module else [])
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} imports {name}" for name in names
                          if name.split(".")[-1].startswith("test_") or name.startswith("tests.test_")]
    assert offenders == []
