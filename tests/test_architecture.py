"""The house's shape, checked from the code: no import cycle between modules, no import of another
package's underscore names, and docs/architecture.md's import map as ``docs/import_map.py`` generates
it (so the page cannot go stale)."""

import importlib.util
import os

from tests import REPO


def import_map():
    spec = importlib.util.spec_from_file_location("import_map", os.path.join(REPO, "docs", "import_map.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle():
    assert import_map().cycles() == []


def test_no_module_imports_another_packages_private_names():
    assert import_map().private_imports() == []


def test_the_architecture_page_holds_the_current_import_map():
    m = import_map()
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
        assert m.rendered() in f.read(), "docs/architecture.md is stale: run python docs/import_map.py --write"


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path):
    """Two modules importing each other (one inside a function) and a private name across packages."""
    for folder in ("galaxy/a", "galaxy/b"):
        os.makedirs(tmp_path / folder)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "galaxy" / "__init__.py").write_text("")
    (tmp_path / "galaxy/a/one.py").write_text("from galaxy.b.two import _hidden\n")
    (tmp_path / "galaxy/b/two.py").write_text("def f():\n    from galaxy.a import one\n_hidden = 1\n")
    m = import_map()
    assert m.cycles(str(tmp_path)) == [["galaxy.a.one", "galaxy.b.two"]]
    assert m.private_imports(str(tmp_path)) == ["galaxy.a.one imports galaxy.b.two._hidden"]


def model_type_branches(root: str) -> list[str]:
    """Places outside galaxy/models and galaxy/config/ that branch on a model family by name (a
    comparison with, or a dict keyed by, a registered model_type) or import a family's module."""
    import ast

    from galaxy.models import MODEL_FAMILIES

    names = set(MODEL_FAMILIES)
    # A family is a package (galaxy/models/<family>/): its family object's module is one of it.
    family_modules = {type(f).__module__.rpartition(".")[0] for f in MODEL_FAMILIES.values()}
    found = []
    for folder, _, files in os.walk(os.path.join(root, "galaxy")):
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if not name.endswith(".py") or rel.startswith(os.path.join("galaxy", "models")) or \
                    rel.startswith(os.path.join("galaxy", "config") + os.sep):
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                named = lambda n: isinstance(n, ast.Constant) and n.value in names  # noqa: E731
                if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators]):
                    found.append(f"{rel}:{node.lineno} compares with a model_type")
                elif isinstance(node, ast.Dict) and any(named(k) for k in node.keys if k is not None):
                    found.append(f"{rel}:{node.lineno} keys a dict by model_type")
                elif isinstance(node, ast.ImportFrom) and any((node.module or "").startswith(m)
                                                              and (node.module or "")[len(m):][:1] in ("", ".")
                                                              for m in family_modules):
                    found.append(f"{rel}:{node.lineno} imports {node.module}")
    return found


def test_no_file_outside_models_branches_on_the_model_type():
    assert model_type_branches(REPO) == []


def test_the_branch_check_sees_a_branch(tmp_path):
    (tmp_path / "galaxy" / "planner").mkdir(parents=True)
    (tmp_path / "galaxy" / "planner" / "x.py").write_text(
        "from galaxy.models.llama import LlamaMLP\nif cfg.model_type == 'bert':\n    pass\nT = {'llama': 1}\n")
    assert model_type_branches(str(tmp_path)) == [
        "galaxy/planner/x.py:1 imports galaxy.models.llama", "galaxy/planner/x.py:2 compares with a model_type",
        "galaxy/planner/x.py:4 keys a dict by model_type"]


def test_the_command_line_imports_without_torch_dynamo():
    """A launcher, ``plan``, ``infer`` and ``--help`` import the CLI without torch._dynamo (about 1.3 s of CPU a
    process); compiled layers, the ring's and the overlapped edges' ``torch.compiler.disable`` and the torch
    pipeline engine import it where they are used. A training rank imports it anyway, at its optimizer's first
    param group (torch.optim)."""
    import subprocess
    import sys

    probe = "import sys, galaxy.cli.main, galaxy.cli.pretrain, galaxy.cli.plan; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr[-2000:])
