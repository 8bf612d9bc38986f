"""The http layer imports only the standard library, httptools, orjson, uvloop and
mashbox.config (ARCHITECTURE.md, "Who may import whom")."""
from __future__ import annotations

import ast
import pathlib
import sys

import mashbox.http

ALLOWED_THIRD_PARTY = {"httptools", "orjson", "uvloop"}


def test_http_imports_only_what_the_layer_rules_allow():
    root = pathlib.Path(mashbox.http.__file__).parent
    bad = []
    files = sorted(root.glob("*.py"))
    assert len(files) >= 7
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside mashbox.http
                    continue
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if name == "mashbox.config" or top in ALLOWED_THIRD_PARTY or top in sys.stdlib_module_names:
                    continue
                if top == "__future__":
                    continue
                bad.append(f"{f.name}: {name}")
    assert bad == []
