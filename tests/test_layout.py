"""The package layout rules (tools/check_layout.py): no import cycle among kvlm modules, no file in kvlm/ over
500 lines, no argument parsing outside kvlm/cli. The checker itself is tested on small synthetic trees."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "check_layout.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("check_layout", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check_layout = _load_tool()


def test_kvlm_layout_is_clean():
    report = check_layout.check(ROOT)
    assert report.ok, "layout violations:\n" + "\n".join(report.lines())


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_checker_finds_cycles_long_files_and_argparse(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kvlm/__init__.py": "",
            "kvlm/a.py": "from kvlm.b import x\n",
            "kvlm/b.py": "def f():\n    from kvlm import a  # inside a function still counts\nx = 1\n",
            "kvlm/c.py": "from . import d\n",  # relative imports resolve
            "kvlm/d.py": "from .c import y\ny = 2\n",
            "kvlm/long.py": "x = 1\n" * 501,
            "kvlm/lib.py": "import argparse\n",
            "kvlm/cli/__init__.py": "import argparse\n",  # the CLI may parse arguments
        },
    )
    report = check_layout.check(root)
    assert report.cycles == [["kvlm.a", "kvlm.b"], ["kvlm.c", "kvlm.d"]]
    assert report.long_files == [("kvlm/long.py", 501)]
    assert report.argparse_outside_cli == ["kvlm/lib.py"]
    assert not report.ok
    res = subprocess.run([sys.executable, str(TOOL), "--root", str(root)], capture_output=True, text=True)
    assert res.returncode == 1
    assert "cycle: kvlm.a <-> kvlm.b" in res.stdout and "argparse outside the CLI: kvlm/lib.py" in res.stdout


def test_checker_passes_a_clean_tree_and_ignores_type_checking_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kvlm/__init__.py": "from kvlm.a import x\n",
            "kvlm/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvlm\nx = 1\n",
            "kvlm/edge.py": "x = 1\n" * 500,
        },
    )
    report = check_layout.check(root)
    assert report.ok, report.lines()
    res = subprocess.run([sys.executable, str(TOOL), "--root", str(root)], capture_output=True, text=True)
    assert res.returncode == 0 and "0 import cycles" in res.stdout
