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
