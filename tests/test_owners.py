"""One owner per piece of state, held statically (as tests/cluster/test_elastic.py holds the router to
building placement tables): only the scheduler assigns a sequence's fields, only the prefix cache
assigns a sequence's cache record (``Seq.cache``, a :class:`~cluster.seq.CacheHold`), and
only the epoch owner (cluster/epochs.py) starts, commits or abandons a shape change. Also: the
engine's fake-driven tests run with Ray not importable and without the shared conftest."""

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.seq import CacheHold, Seq

ROOT = Path(__file__).parents[1]
RUNTIME = ("model", "actors", "cluster", "deploy")
# every field of a sequence (model.runner.Sequence's and the scheduler's additions) and of its cache record
SEQ_FIELDS = frozenset(f.name for f in dataclasses.fields(Seq))
CACHE_FIELDS = frozenset(f.name for f in dataclasses.fields(CacheHold))
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__"}
# the shape-change primitives: the router's proposals and commits, the executor's preparation and
# replacement of actors, the scheduler's resize and rewind
SHAPE_OPS = {"propose", "prepare", "ready", "commit", "abort", "replace", "resize", "rewind"}
SHAPE_OWNERS = {"router", "executor", "scheduler"}


def _runtime_files(packages=RUNTIME):
    for pkg in packages:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _seq_writes(tree, fields=SEQ_FIELDS) -> list[tuple[int, str]]:
    """(line, what) for every assignment to, or in-place change of, ``<x>.<field>`` (a field of
    ``fields``) with ``x`` not ``self`` (a class's own fields are its own business)."""
    out = []

    def target(node) -> str | None:
        if isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in fields and \
                not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            return node.attr
        return None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in fields:
            out.append((node.lineno, f"setattr(..., {node.args[1].value!r})"))
        for t in targets:
            name = target(t)
            if name is not None:
                out.append((node.lineno, name))
    return out


def _shape_calls(tree) -> list[tuple[int, str]]:
    """(line, call) for every ``<…>.router|executor|scheduler.<shape op>(...)``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SHAPE_OPS:
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name in SHAPE_OWNERS:
                out.append((node.lineno, f"{name}.{node.func.attr}"))
    return out


def _outside(owner: str, walk, packages=RUNTIME) -> dict[str, list]:
    """What ``walk`` finds in the runtime files other than ``owner``, by file."""
    found = {}
    for f in _runtime_files(packages):
        rel = str(f.relative_to(ROOT))
        if rel != owner and (hits := walk(ast.parse(f.read_text()))):
            found[rel] = hits
    return found


def _cache_writes(tree) -> list[tuple[int, str]]:
    return _seq_writes(tree, CACHE_FIELDS)


def test_the_owner_checks_cover_every_field():
    """Every field of Seq and of its cache record is guarded, and none is guarded twice: the two
    owners' field names are apart, so a write names its owner."""
    assert {"replica", "num_preemptions", "cache_salt", "num_hit", "is_refresh", "reset_state_next", "cache",
            "block_table", "num_cached", "token_ids", "finish_reason", "state_slot"} <= SEQ_FIELDS
    assert {"hashes", "snapshot", "snapshot_at", "pending_snapshot", "on_grid", "num_registered_blocks",
            "branch_point"} == CACHE_FIELDS
    assert not SEQ_FIELDS & CACHE_FIELDS


def test_only_the_scheduler_assigns_sequence_fields():
    found = _outside("cluster/scheduler.py", _seq_writes, ("actors", "cluster", "deploy"))
    assert not found, f"sequence fields written outside cluster/scheduler.py: {found}"
    assert _seq_writes(ast.parse((ROOT / "cluster/scheduler.py").read_text())), "the walk sees the scheduler's writes"


def test_only_the_prefix_cache_assigns_a_sequences_cache_record():
    found = _outside("cluster/prefix_cache.py", _cache_writes, ("actors", "cluster", "deploy"))
    assert not found, f"cache-record fields written outside cluster/prefix_cache.py: {found}"
    assert _cache_writes(ast.parse((ROOT / "cluster/prefix_cache.py").read_text())), \
        "the walk sees the prefix cache's writes"


@pytest.mark.parametrize("owner,checker,line,field", [
    ("cluster/prefix_cache.py", _seq_writes, "seq.reset_state_next = False", "reset_state_next"),
    ("cluster/prefix_cache.py", _seq_writes, "job.block_table.append(3)", "block_table"),
    ("cluster/scheduler.py", _cache_writes, "seq.cache.snapshot_at = 0", "snapshot_at"),
    ("cluster/scheduler.py", _cache_writes, "seq.cache.hashes.clear()", "hashes"),
    ("cluster/engine.py", _seq_writes, "req.seq.is_refresh = True", "is_refresh"),
])
def test_a_write_in_the_wrong_owner_is_caught(owner, checker, line, field):
    """Break it: a real runtime module with one write of another owner's field added is flagged,
    at that line (the other owner's checks see it too)."""
    src = (ROOT / owner).read_text()
    assert field not in {w for _, w in checker(ast.parse(src))}, f"{owner} already writes {field}"
    broken = src + f"\n\ndef _broken(seq, job, req):\n    {line}\n"
    found = checker(ast.parse(broken))
    assert (broken.count("\n"), field) in found, found


def test_the_seq_check_catches_an_engine_that_appends_tokens():
    """The check above can fail: the engine's old way of applying a step is flagged."""
    old = "def _apply(self, seq, tok, req):\n    seq.token_ids.append(tok)\n    seq.num_cached -= 1\n" \
          "    req.seq.finish_reason = 'stop'\n    seq.block_table[0] = 3\n"
    assert sorted(w for _, w in _seq_writes(ast.parse(old))) == ["block_table", "finish_reason", "num_cached", "token_ids"]


def test_only_the_epoch_owner_changes_the_shape():
    found = _outside("cluster/epochs.py", _shape_calls)
    assert not found, f"shape changes started outside cluster/epochs.py: {found}"
    own = {c for _, c in _shape_calls(ast.parse((ROOT / "cluster/epochs.py").read_text()))}
    assert {"router.propose", "executor.prepare", "executor.commit", "executor.replace",
            "scheduler.rewind", "scheduler.resize"} <= own, own


def _run_without_ray(tmp_path, files: list[str], timeout_s: float, *options: str) -> subprocess.CompletedProcess:
    """pytest on ``files`` with ``import ray`` failing and the shared conftest off."""
    blocker = tmp_path / "ray"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('ray is not importable in this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                           "--durations=10", *options, *files], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def _passed(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "error" not in proc.stdout.splitlines()[-1], proc.stdout[-500:]
    print(proc.stdout[-3000:])  # the durations, shown with -rP


def test_fake_tests_need_no_ray(tmp_path):
    """Every tests/**/test_*fake*.py (the engine over the fake executor) passes with ``import ray``
    failing and the shared conftest off. The whole suite (and the fast subset) runs them here, once;
    named on the command line, they run as usual."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*fake*.py"))
    assert files, "no fake-driven tests found"
    _passed(_run_without_ray(tmp_path, files, 300))


@pytest.mark.cluster
@pytest.mark.timeout(1500)
def test_inprocess_tests_need_no_ray(tmp_path):
    """Every tests/**/test_*inproc*.py (the serving app in one process: HTTP semantics) passes with
    ``import ray`` failing and the shared conftest off. The whole suite runs them here, once (the
    conftest leaves them out of a run given no paths); named on the command line, they run as usual."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*inproc*.py"))
    assert len(files) >= 5, files
    # two workers (pytest-xdist): each test's app runs in its worker's process, and both cores are used
    _passed(_run_without_ray(tmp_path, files, 1400, "-n", "2"))


@pytest.mark.parametrize("probe", ["import ray", "from cluster.topology import reserve"])
def test_the_ray_blocker_blocks(tmp_path, probe):
    blocker = tmp_path / "ray"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('blocked')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "blocked" in proc.stderr
