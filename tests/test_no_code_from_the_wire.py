"""Nothing kvd receives is unpickled, evaluated or imported (DESIGN.md:
messages never carry pickled Python objects).

An AST check of every module under kvd/ (the generated stubs included): no
deserializer that can run code (pickle and friends, yaml.load, torch.load,
numpy.load with allow_pickle), no eval/exec/compile/__import__, no import by a
computed name. Wire input is parsed only by protobuf, by ``bytes.decode`` and
by int()/float(). A use that is ever needed goes in ALLOWED with its reason.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvd"

FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle",
                     "joblib", "runpy", "code", "codeop"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_ATTRIBUTES = {
    "import_module", "spec_from_file_location", "spec_from_loader", "module_from_spec", "exec_module",
    "load_module", "run_path", "run_module",       # importing code by a name or path
    "unsafe_load", "full_load", "load_all",         # yaml
    "loads", "load",                                # checked below: only on modules that run code
}
# Attribute calls "x.load(...)" / "x.loads(...)" are fine on json and the like;
# forbidden on these receivers.
CODE_RUNNING_LOADERS = {"pickle", "marshal", "yaml", "torch", "dill", "cloudpickle", "jsonpickle", "joblib",
                        "shelve"}

# (file relative to the repository, what) -> why it is safe.
ALLOWED: dict[tuple[str, str], str] = {
    ("kvd/bench/daemon_entry.py", "importlib.import_module()"):
        "benchmark harness: imports modules named on its own command line (--set), never from a message",
}


def violations(source: str, filename: str) -> list[str]:
    """Every forbidden use in ``source``, as ``file:line: what``."""
    out = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
            what = f"import {', '.join(bad)}" if bad else None
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in FORBIDDEN_MODULES:
                what = f"from {node.module} import ..."
            elif any(a.name in FORBIDDEN_ATTRIBUTES - {"load", "loads"} for a in node.names):
                what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in FORBIDDEN_BUILTINS:
                what = f"{f.id}()"
            elif isinstance(f, ast.Attribute) and f.attr in FORBIDDEN_ATTRIBUTES:
                receiver = ast.unparse(f.value).split(".")[0]
                if f.attr not in ("load", "loads") or receiver in CODE_RUNNING_LOADERS:
                    what = f"{ast.unparse(f)}()"
            if isinstance(f, ast.Attribute) and f.attr == "load" and any(
                    k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                    for k in node.keywords):
                what = f"{ast.unparse(f)}(allow_pickle=...)"
        if what and (filename, what) not in ALLOWED:
            out.append(f"{filename}:{node.lineno}: {what}")
    return out


def test_no_module_of_kvd_unpickles_evaluates_or_imports_what_it_is_given():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20 and (PACKAGE / "v1" / "kvd_pb2.py") in files
    found = []
    for path in files:
        found += violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "code or objects from data:\n" + "\n".join(found)


def test_the_check_finds_what_it_forbids():
    bad = """
import pickle
from marshal import loads
import importlib
import yaml, numpy as np, json
pickle.loads(b"")
eval("1")
exec("x = 1")
__import__("os")
importlib.import_module(name)
yaml.load(text)
np.load(path, allow_pickle=True)
json.loads("{}")
re.compile("x")
model.eval()
"""
    found = {v.split(": ", 1)[1] for v in violations(bad, "x.py")}
    assert found == {"import pickle", "from marshal import ...", "pickle.loads()", "eval()", "exec()",
                     "__import__()", "importlib.import_module()", "yaml.load()", "np.load(allow_pickle=...)"}, found
