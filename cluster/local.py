"""A throwaway multi-node Ray cluster on this machine, for tests and `moeray generate --nodes K`.

Owns the Ray node processes it starts (head + K-1 workers via `ray.cluster_utils.Cluster`) and
stops every one of them. It does not connect a driver: callers do `ray.init(address=...)`.

Each node gets its own loopback IP (127.0.0.2, .3, ...) so that nodes are told apart by IP as
on a real cluster, explicit resources (each node would otherwise claim the whole machine; the
object store would take ~7.5 GB of /dev/shm), no dashboard, random ports, and a custom resource
`moeray_node_<i>` naming it. Token auth is left as the calling process has it (off unless
RAY_AUTH_MODE=token is set, which a bare `ray.init()` earlier in the process also does); GCS,
raylets and driver read the same environment, so they agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray._private import ray_constants
from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
from ray.cluster_utils import Cluster

from .config import RAY_NODE_ENV

log = logging.getLogger(__name__)

MiB = 2**20


@dataclass(frozen=True)
class GcsRedis:
    """The Redis a head node's GCS keeps its tables in (Ray's GCS fault tolerance): a GCS started
    again on the same Redis, within the raylets' reconnect timeout, finds the cluster as it was."""

    address: str  # host:port
    password: str = ""
    namespace: str | None = None  # keeps clusters that share one Redis apart


def _check_auth() -> None:
    # In token mode a GCS without a token never comes up: Ray's own error is a timeout waiting
    # for a port file. ray.init() would write ~/.ray/auth_token; this throwaway cluster won't.
    if get_authentication_mode() == AuthenticationMode.TOKEN and not AuthenticationTokenLoader.instance().has_token(
        ignore_auth_mode=True
    ):
        raise RuntimeError(
            "Ray token authentication is on (RAY_AUTH_MODE=token) but no token exists: "
            "create one with `ray get-auth-token --generate`, or set RAY_AUTH_MODE=disabled for throwaway clusters"
        )


class LocalCluster:
    """K Ray nodes on one machine. `start()`/`shutdown()` or use as a context manager."""

    def __init__(
        self,
        nodes: int = 3,
        *,
        num_cpus: float = 4,
        num_gpus: float = 0,
        object_store_mb: int = 80,
        memory_mb: int = 2048,
        env: dict[str, str] | None = None,
        first_ip: int = 2,
        wait_s: float = 60,
        gcs_redis: GcsRedis | None = None,
        head_num_cpus: float | None = None,
    ) -> None:
        """`num_cpus`, `num_gpus`, `memory_mb` are logical, per node. `env` is added to each
        raylet's environment, after :data:`~cluster.config.RAY_NODE_ENV`, and so reaches every worker
        process (not the GCS or this driver). `gcs_redis`: the head's GCS keeps its state there, so
        that :meth:`restart_gcs` and :meth:`restart_head` find the cluster as it was. `head_num_cpus`:
        the head's, when not `num_cpus` (0: no actor that needs a CPU goes there, as on KubeRay)."""
        if nodes < 1 or nodes > 250:
            raise ValueError(f"nodes must be in [1, 250] (one loopback IP each), got {nodes}")
        for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus), ("memory_mb", memory_mb)):
            if value < 0:
                raise ValueError(f"{name} must be ≥ 0, got {value}")
        if object_store_mb < 75:  # Ray's minimum object store is 75 MiB
            raise ValueError(f"object_store_mb must be ≥ 75, got {object_store_mb}")
        self.nodes = nodes
        if not 2 <= first_ip <= 255 - nodes:
            raise ValueError(f"first_ip must leave room for {nodes} loopback addresses in 127.0.0.2..254, got {first_ip}")
        # 127.0.0.1 is rewritten by Ray; first_ip keeps two clusters on one machine apart
        self.node_ips = [f"127.0.0.{first_ip + i}" for i in range(nodes)]
        self._node_args = dict(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=object_store_mb * MiB,
            memory=memory_mb * MiB,
            env_vars=RAY_NODE_ENV | dict(env or {}),
        )
        self._wait_s = wait_s
        self.gcs_redis = gcs_redis
        self.head_num_cpus = head_num_cpus
        self._cluster: Cluster | None = None

    def _args(self, i: int) -> dict:
        return dict(self._node_args, node_ip_address=self.node_ips[i], resources={f"moeray_node_{i}": 1.0})

    def _head_args(self) -> dict:
        head = dict(self._args(0), include_dashboard=False, dashboard_agent_listen_port=None)
        if self.head_num_cpus is not None:
            head["num_cpus"] = self.head_num_cpus
        if self.gcs_redis is not None:
            # as `ray start --head` does with $RAY_REDIS_ADDRESS: the one Redis is also the one shard
            head |= dict(external_addresses=[self.gcs_redis.address] * 2, num_redis_shards=1,
                         redis_password=self.gcs_redis.password)
            if self.gcs_redis.namespace:
                head["_system_config"] = {"external_storage_namespace": self.gcs_redis.namespace}
        return head

    def start(self) -> LocalCluster:
        if self._cluster is not None:
            raise RuntimeError("LocalCluster already started")
        _check_auth()
        head = self._head_args()
        try:
            self._cluster = Cluster(initialize_head=True, head_node_args=head, shutdown_at_exit=True)
            for i in range(1, self.nodes):
                self._cluster.add_node(wait=False, **self._args(i))
            self._cluster.wait_for_nodes(timeout=self._wait_s)
        except BaseException:
            self.shutdown()
            raise
        self._forget_address_file()
        return self

    def _forget_address_file(self) -> None:
        # Cluster writes its address to /tmp/ray/ray_current_cluster, where a bare `ray.init()`
        # anywhere on the machine would find it and join this throwaway cluster. Nothing here
        # needs the file: callers connect with `address`.
        if ray._private.utils.read_ray_address() == self.address:
            ray._common.utils.reset_ray_address()

    def add_node(self, ip: str, *, num_cpus: float | None = None):
        """One more node at loopback ``ip`` (a node that joins later, or comes back); its handle."""
        if self._cluster is None:
            raise RuntimeError("LocalCluster is not running: call start() first")
        args = dict(self._node_args, node_ip_address=ip)
        if num_cpus is not None:
            args["num_cpus"] = num_cpus
        node = self._cluster.add_node(wait=True, **args)
        self._cluster.wait_for_nodes(timeout=self._wait_s)
        return node

    def remove_node(self, node) -> None:
        """Stop one node (as if its machine died): every actor on it dies with it."""
        if self._cluster is None:
            raise RuntimeError("LocalCluster is not running: call start() first")
        self._cluster.remove_node(node, allow_graceful=False)

    @property
    def address(self) -> str:
        """The GCS address ("ip:port") to pass to `ray.init(address=...)`."""
        if self._cluster is None or self._cluster.address is None:
            raise RuntimeError("LocalCluster is not running: call start() first")
        return self._cluster.address

    def process_ids(self, *, head_only: bool = False) -> list[int]:
        """PIDs of the Ray processes (GCS, raylets, agents) of every node it started (of the head only)."""
        if self._cluster is None:
            return []
        nodes = [self._cluster.head_node] if head_only else self._cluster.list_all_nodes()
        # only those that run: a dead one's PID may since belong to another process
        return [info.process.pid for node in nodes if node is not None
                for infos in node.all_processes.values() for info in infos if info.process.poll() is None]

    def _head_process_alive(self, kind: str) -> bool:  # no head node (a restart that failed): False
        head = self._cluster.head_node if self._cluster is not None else None
        infos = head.all_processes.get(kind) if head is not None else None
        return bool(infos) and infos[0].process.poll() is None

    def gcs_alive(self) -> bool:
        """The head's GCS process (``gcs_server``) runs."""
        return self._head_process_alive(ray_constants.PROCESS_TYPE_GCS_SERVER)

    def head_alive(self) -> bool:
        """The head node's raylet runs (a head node killed whole loses it with its GCS)."""
        return self._head_process_alive(ray_constants.PROCESS_TYPE_RAYLET)

    def restart_gcs(self) -> None:
        """Start the head's GCS again, on its port (the raylets and workers reconnect to it there).
        Only with ``gcs_redis``: a GCS without one starts empty, a different cluster."""
        self._need_redis()
        head = self._cluster.head_node
        head.kill_gcs_server(check_alive=False)
        head.start_gcs_server()

    def restart_head(self) -> None:
        """Stop what is left of the head node and start a new one at the same IP and GCS port (a head
        machine that came back): the worker nodes reconnect, the GCS restarts the detached actors the
        old head held (Serve's controller). Only with ``gcs_redis``."""
        self._need_redis()
        cluster = self._cluster
        port = int(self.address.rsplit(":", 1)[1])
        if cluster.head_node is not None:
            cluster.head_node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            cluster.head_node = None
        try:
            cluster.add_node(wait=True, **self._head_args(), gcs_server_port=port)
        except BaseException:
            if cluster.head_node is not None:  # half started: stop it, and let a retry start afresh
                cluster.head_node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
                cluster.head_node = None
            raise
        self._forget_address_file()

    def _need_redis(self) -> None:
        if self._cluster is None:
            raise RuntimeError("LocalCluster is not running: call start() first")
        if self.gcs_redis is None:
            raise RuntimeError("a head restarted without GCS fault tolerance (gcs_redis) starts a new, empty cluster")

    def shutdown(self) -> None:
        """Stop every node it started (workers first, head last). Idempotent. Disconnects this
        process's driver first if it is connected here; raises after trying every node if a node
        would not stop."""
        cluster, self._cluster = self._cluster, None
        if cluster is None:
            return
        if ray.is_initialized() and cluster.address and ray.get_runtime_context().gcs_address == cluster.address:
            ray.shutdown()
        errors = []
        for node in list(cluster.worker_nodes) + [cluster.head_node]:
            if node is None:
                continue
            try:
                cluster.remove_node(node, allow_graceful=True)
            except Exception as e:  # keep going: every node must be stopped
                errors.append(f"{node.node_ip_address}: {e!r}")
                node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        # What Cluster.shutdown() does after removing nodes: forget the dead GCS.
        ray.experimental.internal_kv._internal_kv_reset()
        ray._private.services.find_gcs_addresses.cache_clear()
        if errors:
            raise RuntimeError("LocalCluster.shutdown: nodes did not stop cleanly: " + "; ".join(errors))

    def __enter__(self) -> LocalCluster:
        return self if self._cluster is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
