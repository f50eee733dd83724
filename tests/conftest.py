"""Shared Ray fixtures for cluster tests, the tiers (the `cluster` mark that the fast subset
(``python -m pytest -q -m "not cluster" -n 2``) leaves out, `operator`, `ray_queue`), and the in-process and fake-driven tests run
once with Ray blocked (:func:`pytest_ignore_collect`)."""

import fnmatch
import json
import os
import shutil
import tempfile

# One OpenMP thread in this process (the driver runs the engine and the in-process apps), set before
# anything imports torch: on 2 cores beside Ray's actors, a second thread only spins. Every actor and
# Serve replica runs with its own count already (Ray: its num_cpus; actors: set_num_threads). The fast
# subset's two xdist workers inherit it: 107 s, against 200 s with two threads each (and 132 s serial).
os.environ.setdefault("OMP_NUM_THREADS", "1")
import socket
import time
from pathlib import Path

import pytest
import ray

from cluster.local import LocalCluster


@pytest.fixture(scope="session")
def ray_cluster():
    """A 3-node Ray cluster on this machine (127.0.0.2-4, 4 logical CPUs each) with this process's
    driver connected. One per test session: starting it costs ~7 s. Tests must release what they
    reserve and kill the actors they create."""
    if ray.is_initialized():
        pytest.fail("ray_cluster: this process already has a Ray driver; ray.shutdown() it before using the fixture")
    with LocalCluster(nodes=3, num_cpus=4, object_store_mb=80, memory_mb=2048) as cluster:
        ray.init(address=cluster.address)
        try:
            yield cluster
        finally:
            ray.shutdown()


def wait_until_idle(timeout_s: float = 30.0) -> None:
    """Wait until every node's CPUs are free again. Ray frees a removed placement group's and a
    killed actor's resources asynchronously, so a test that plans on an empty cluster right after
    another test released its reservation must wait for that first; fails naming what is held."""
    deadline = time.monotonic() + timeout_s
    while True:
        total = {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]}
        free = ray._private.state.available_resources_per_node()
        held = {nid[:8]: cpus - free.get(nid, {}).get("CPU", 0.0) for nid, cpus in total.items()
                if free.get(nid, {}).get("CPU", 0.0) < cpus}
        if not held:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the Ray cluster is still busy {timeout_s:.0f} s after the last test: CPUs held per node {held}")
        time.sleep(0.1)


@pytest.fixture
def idle_cluster(ray_cluster):
    """The session's cluster once nothing holds its CPUs (see :func:`wait_until_idle`)."""
    wait_until_idle()
    return ray_cluster


@pytest.fixture(scope="session")
def serve_port(ray_cluster):
    """Ray Serve's HTTP proxy on a free loopback port, started once for the session (a second
    serve.start cannot move the proxy, and serve.shutdown() costs ~30 s each time) as `moeray up`
    starts it: one proxy, on the head node. Modules deploy their apps under their own names and
    delete them; the cluster's shutdown ends Serve."""
    from deploy.server import start_proxy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_proxy("127.0.0.1", port)
    return port


# ---- the tiers, each declared where the test stands --------------------------------------------------------
# cluster: a test of the session's Ray cluster (it uses one of these fixtures, transitively) or one that
# says so (``pytest.mark.cluster``); operator: one with a cluster or processes of its own
# (``pytest.mark.operator``, itself a cluster test); ray_queue: a module that runs in the Ray tests' queue.
CLUSTER_FIXTURES = {"ray_cluster", "idle_cluster", "serve_port"}


# ---- the in-process and fake-driven tests: run once, with Ray blocked ---------------------------------------
# the serving app in one process (tests/deploy/inproc.py), and the engine over the fake executor: no Ray
WITHOUT_RAY = ("test_*inproc*.py", "test_*fake*.py")


def pytest_ignore_collect(collection_path, config):
    """A run given no paths (the whole suite, as CI runs it; or the fast subset) leaves the in-process
    and fake-driven modules out: tests/test_owners.py runs every one of them with ``import ray`` failing
    (test_inprocess_tests_need_no_ray, test_fake_tests_need_no_ray), so each runs once. Named on the
    command line (a file, a directory) they are collected as usual."""
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and \
            any(fnmatch.fnmatch(collection_path.name, pattern) for pattern in WITHOUT_RAY):
        return True
    return None


# ---- xdist groups (``-n 2 --dist loadgroup``, as CI runs the suite) -----------------------------------
# Every test of the session's Ray cluster and Serve proxy runs on one worker, in file order, first; the
# other worker runs the tests with a cluster or processes of their own first (the `operator` mark, one after
# another, never two beside each other: one unit of ~7 minutes), then the rest, a module at a time (its module
# fixtures built once), which the first worker shares once the Ray tests are done: both end together (with
# the own group last, the first worker idled its last three minutes while the other ran it).
# The in-process tier's runner starts no Ray: it runs beside the Ray tests too. pytest-xdist's own loadgroup renames test ids
# to carry the group, which pytest 9.2's structured node ids ignore; so the workers write each test's
# group to a file (collection ends before scheduling starts) and :class:`_GroupScheduling` reads it.
RAY_GROUP = "ray"
# Tests with a cluster or processes of their own (the ``operator`` mark): one group, the first unit of the
# worker that is not running the session cluster's tests, one after the other.
OWN_GROUP = "own"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    groups = {}
    for item in items:
        path = Path(os.path.relpath(item.path, config.rootpath)).as_posix()
        ray_tier = bool(CLUSTER_FIXTURES & set(item.fixturenames))
        operator = item.get_closest_marker("operator") is not None
        if (ray_tier or operator) and item.get_closest_marker("cluster") is None:
            item.add_marker(pytest.mark.cluster)
        if operator:
            groups[item.nodeid] = OWN_GROUP
        else:
            groups[item.nodeid] = RAY_GROUP if ray_tier or item.get_closest_marker("ray_queue") else path
    out = getattr(config, "workerinput", {}).get("moeray_groups")
    if out:  # an xdist worker: tell the controller's scheduler (every worker writes the same)
        tmp = f"{out}.{os.getpid()}"
        Path(tmp).write_text(json.dumps(groups))
        os.replace(tmp, out)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config._moeray_groups = tempfile.mkdtemp(prefix="moeray-xdist-") + "/groups.json"


def pytest_unconfigure(config):
    if getattr(config, "_moeray_groups", None):
        shutil.rmtree(os.path.dirname(config._moeray_groups), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["moeray_groups"] = node.config._moeray_groups


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _GroupScheduling(LoadScopeScheduling):
        """Tests of one group on one worker, in collection order; the Ray group goes out first, the own group second."""

        _groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                self._groups = json.loads(Path(config._moeray_groups).read_text())
            return self._groups.get(nodeid) or nodeid.split("::")[0]

        def _assign_work_unit(self, node) -> None:
            if not self.assigned_work.get(node):  # a worker's first unit: the Ray group, then the own group
                for first in (OWN_GROUP, RAY_GROUP):
                    if first in self.workqueue:
                        self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False
    return _GroupScheduling(config, log)
