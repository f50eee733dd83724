"""The import arrows of docs/architecture.md ("Folders"): a test walks every module's imports and fails when an
arrow points the wrong way, when the package imports transformers (a test-only reference), or
when anything but deploy/settings.py reads environment variables."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FORBIDDEN = {
    "model": {"ray", "fastapi", "starlette", "actors", "cluster", "deploy", "transformers", "prometheus_client"},
    "actors": {"cluster", "deploy", "fastapi", "starlette", "transformers"},
    "cluster": {"deploy", "fastapi", "starlette", "transformers"},
    "deploy": {"transformers"},
}
ENV_READER = ROOT / "deploy" / "settings.py"


def _modules():
    for pkg in FORBIDDEN:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, f


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


@pytest.mark.parametrize("pkg,path", list(_modules()), ids=lambda v: str(v).replace(str(ROOT) + "/", ""))
def test_import_arrows(pkg, path):
    tree = ast.parse(path.read_text())
    bad = sorted(set(_imports(tree)) & FORBIDDEN[pkg])
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}, which {pkg}/ must not"
    if path != ENV_READER:
        src = path.read_text()
        assert "os.environ" not in src and "getenv" not in src, f"{path.relative_to(ROOT)} reads the environment"


def test_walk_sees_every_package():
    assert {p for p, _ in _modules()} >= {"model", "deploy"}
