"""The import arrows of docs/architecture.md ("Folders"): a test walks every module's imports and fails when an
arrow points the wrong way, when the package imports transformers (a test-only reference), or
when anything but deploy/settings.py reads environment variables."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FORBIDDEN = {
    "model": {"ray", "fastapi", "starlette", "actors", "cluster", "deploy", "transformers", "prometheus_client",
              "training"},
    "actors": {"cluster", "deploy", "fastapi", "starlette", "transformers", "training"},
    "cluster": {"deploy", "fastapi", "starlette", "transformers", "training"},
    "deploy": {"transformers", "training"},
    # training the shipped preset (scripts/train_preset.py) through model/'s code; nothing above imports it
    "training": {"ray", "fastapi", "starlette", "actors", "cluster", "deploy", "transformers", "prometheus_client"},
}
RUNTIME = ("model", "actors", "cluster", "deploy")
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


def test_the_runtime_never_imports_the_capacity_wing():
    """cluster/capacity/ (the simulator, its costs and the capacity search) sits above the engine: used by
    `moeray simulate` / `plan` and the benchmarks, never by the runtime in cluster/."""
    found = []
    for f in sorted((ROOT / "cluster").rglob("*.py")):
        if "capacity" in f.relative_to(ROOT / "cluster").parts:
            continue
        names = set(_local_imports(ast.parse(f.read_text()), "cluster." + f.stem, "cluster"))
        found += [(f.name, n) for n in names if n.startswith("cluster.capacity")]
    assert not found, found


def test_walk_sees_every_package():
    assert {p for p, _ in _modules()} >= {"model", "deploy"}


# ---- no runtime file over 600 lines: a file that grows past that is asking to be split by owner -------------
MOST_LINES = 600


def _too_long(paths, most: int = MOST_LINES) -> dict[str, int]:
    """Each file of ``paths`` with more than ``most`` lines, and its count."""
    counts = {str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f): len(f.read_text().splitlines())
              for f in paths}
    return {f: n for f, n in counts.items() if n > most}


def test_no_runtime_file_is_over_600_lines():
    """model/, actors/, cluster/ and deploy/ (docs/STYLE.md: modules up to ~400 lines)."""
    assert not _too_long(f for pkg, f in _modules() if pkg in RUNTIME)


def test_the_length_check_catches_a_long_file(tmp_path):
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MOST_LINES + 1))
    short.write_text("x = 1\n" * MOST_LINES)
    assert _too_long([long, short]) == {str(long): MOST_LINES + 1}


# ---- text exists only on the Ingress (deploy/output.py): the engine and the actors move token ids ----------
TEXT_MODULES = {"model.tokenizer", "model.tokenizer_backends", "tokenizers", "tiktoken"}
TEXT_NAMES = {"Tokenizer", "IncrementalDecoder", "detokenize", "decode_text"}


def _text_uses(tree) -> list[tuple[int, str]]:
    """(line, what) for every import of a tokenizer module or of a decoding name, and every use of a
    decoding name: what a module needs to turn token ids into text."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name in TEXT_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module in TEXT_MODULES:
                out.append((node.lineno, node.module))
            out += [(node.lineno, a.name) for a in node.names if a.name in TEXT_NAMES]
        elif isinstance(node, ast.Name) and node.id in TEXT_NAMES:
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in TEXT_NAMES:
            out.append((node.lineno, node.attr))
    return out


def test_no_module_of_the_engine_or_the_actors_decodes_text():
    """cluster/ and actors/ stream token ids; the Ingress's output processor makes the text."""
    found = {}
    for pkg in ("cluster", "actors"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if hits := _text_uses(ast.parse(f.read_text())):
                found[str(f.relative_to(ROOT))] = hits
    assert not found, f"modules that decode text outside the front end: {found}"
    assert _text_uses(ast.parse((ROOT / "deploy" / "output.py").read_text())), "the walk sees the output processor's"


def test_the_output_processor_imports_no_protocol_module():
    """deploy/output.py shapes text and logprobs; the API modules render what it makes, not the other way."""
    protocols = {"deploy.openai_api", "deploy.anthropic_api", "deploy.responses_api"}
    imports = _local_imports(ast.parse((ROOT / "deploy" / "output.py").read_text()), "deploy.output", "deploy")
    assert not imports & protocols, imports & protocols
    assert _local_imports(ast.parse("from .openai_api import StopStrings\n"), "deploy.output", "deploy") & protocols


def test_the_text_check_catches_the_engine_thread_that_decoded():
    """The check above can fail: the async engine as it was (it detokenised each stream) is flagged."""
    old = ("from model.tokenizer import IncrementalDecoder, Tokenizer\n"
           "def _stream(tok, params):\n    return IncrementalDecoder(tok, skip_special_tokens=params.skip)\n")
    assert {w for _, w in _text_uses(ast.parse(old))} >= {"model.tokenizer", "IncrementalDecoder", "Tokenizer"}


# ---- no import circle inside a folder ---------------------------------------------------------------------------
def _local_imports(tree, module: str, pkg: str) -> set[str]:
    """The modules of folder ``pkg`` that ``module`` (dotted, e.g. ``cluster.scheduler``) imports
    anywhere in its text: at the top, inside functions, under ``TYPE_CHECKING`` alike."""
    out, parent = set(), module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == pkg}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parent.rsplit(".", node.level - 1)[0] if node.level > 1 else parent
                target = f"{base}.{node.module}" if node.module else base
            elif node.module and node.module.split(".")[0] == pkg:
                target = node.module
            else:
                continue
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}  # `from . import x`: the module x
    return out


def _circles(sources: dict[str, str]) -> list[list[str]]:
    """The import circles among ``sources`` (dotted module name → its text): each a strongly
    connected group of two or more modules, or one that imports itself."""
    graph = {m: sorted(_local_imports(ast.parse(src), m, m.split(".")[0]) & sources.keys())
             for m, src in sources.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_sources() -> dict[str, str]:
    out = {}
    for pkg in FORBIDDEN:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            out[name] = f.read_text()
    return out


def test_no_import_circle_inside_a_folder():
    """Modules of one folder import each other one way only (a local or TYPE_CHECKING import counts: it
    hides a circle, it does not open it)."""
    assert not _circles(_package_sources())


def test_the_circle_check_finds_a_planted_circle():
    sources = {"cluster.a": "from .b import B\n", "cluster.b": "def f():\n    from cluster.c import C\n",
               "cluster.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
               "cluster.d": "from .a import A\n", "model.x": "import model.x\n"}
    assert _circles(sources) == [["cluster.a", "cluster.b", "cluster.c"], ["model.x"]]
    sources["cluster.c"] = "import os\n"
    assert _circles(sources) == [["model.x"]]
