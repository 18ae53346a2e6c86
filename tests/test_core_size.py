"""`scripts/bench.py size`'s cycle finder on planted modules: the issue's goal of no import cycles is measured by
it."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench  # noqa: E402


def plant(root, files: dict):
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "w") as f:
            f.write(text)


def test_the_cycle_finder_finds_planted_cycles_and_only_those(tmp_path):
    plant(tmp_path, {
        "a.py": "import os\nfrom b import x\n",
        "b.py": "try:\n    import a\nexcept ImportError:\n    pass\nx = 1\n",  # a <-> b at the top level
        "c.py": "def f():\n    from d import y  # deferred\n    return y\n",
        "d.py": "import c\ny = 2\n",  # c <-> d only through c's deferred import
        "e.py": "import a\nif __name__ == '__main__':\n    import e_cli\n",
        "e_cli.py": "import e\n",  # the entry stub's import is no cycle
        "pkg/__init__.py": "from . import inner\n",
        "pkg/inner.py": "import c\n",
        "tests/t.py": "import a\n",  # tests/ is no engine module
    })
    assert bench.import_cycles(str(tmp_path)) == [["a", "b"]]
    assert bench.import_cycles(str(tmp_path), deferred=True) == [["a", "b"], ["c", "d"]]
    assert sorted(bench.import_graph(str(tmp_path))["pkg"]) == ["c"]


def test_the_hand_overs_by_name_are_listed_with_who_names_them(tmp_path):
    plant(tmp_path, {
        "families.py": "import importlib\ndef family(name):\n    return importlib.import_module(name)\n"
                       "def rope():\n    return family('rope')\n",
        "core.py": "import families\ndef auto():\n    return families.family('budget').x\n",
        "other.py": "def f(family):\n    return family.name('nope'), getattr(family, 'x')\n",  # not a hand-over
        "tests/t.py": "import families\nfamilies.family('tested')\n",  # tests/ is no engine module
    })
    assert bench.hand_overs(str(tmp_path)) == {"budget": ["core"], "rope": ["families"]}
