"""A throwaway `ray up` target on this machine, for tests: a private sshd on two loopback aliases, a
throwaway user and key, and the shipped deploy/ray-cluster-local.yaml with only what a test must
change rewritten (addresses, ports, login, the install step). Owns every process it starts and the
user it creates; `close()` stops them by PID and removes them, and never touches anything else.

Why each rewrite (the rest of the YAML runs as shipped):
- Two loopback aliases out of 127.0.0.20-39 on which nothing listens on port 22, and free ports for
  GCS, dashboard, client server, agents, metrics export and Serve: other tests' clusters use
  127.0.0.2-4, .40 and random ports; nothing here may collide with them, nor with a second run of this
  test on the same machine.
- sshd listens on port 22 of the two aliases only: Ray's schema has no ssh port, and the head's
  autoscaler drops `auth.ssh_proxy_command` when it reaches the workers, so the port must be 22.
  The sockets on port 22 must be this sshd's own (checked by socket inode), never another's: a
  leftover sshd of a killed run once held 127.0.0.20/21:22, the new sshd could not bind, the check
  "port 22 answers" passed, and `ray up` retried ssh into the stranger ("Permission denied
  (publickey)") until the test's limit. A system sshd on 0.0.0.0:22 makes this fail loudly.
- A throwaway unprivileged user: Ray's commands run `ray stop`, which kills every Ray process the
  login may kill. As this user it can only reach its own processes, never another cluster's. Its
  RAY_TMPDIR is private (session files, ray_current_cluster, the local provider's state), so no
  other cluster's address file is read or written.
- The `pip install` setup commands are replaced by a prepared venv (tests never reach a package
  registry), linked as ~/moeray-venv: an interpreter of the same Python minor version that the
  throwaway user can execute (this venv's own base may sit under /root), whose site-packages are
  this venv's, with PYTHONPATH=~/moeray so the nodes import the rsynced tree — what
  `pip install -e ~/moeray` gives.
- The Ray token is a throwaway one (file_mounts copies it, as the YAML does with ~/.ray/auth_token),
  and so is the app's admin key (copied as the YAML copies ~/.moeray/admin_key; the YAML's `ray
  start` commands put it in MOERAY_ADMIN_KEY, as shipped).
- `ray up` runs from a copy of the repository root holding what the YAML's rsync would send (its
  rsync_exclude and .gitignore filter): Ray hashes every file under a file mount before it syncs, and
  ignores rsync's excludes while hashing, so in CI (.venv inside the checkout) it would read 1.6 GB.

A run killed by SIGKILL runs no `finally`: sshd dies with it (PR_SET_PDEATHSIG), and the next run
removes the throwaway users (their processes, by PID, and files) whose creating process is gone.
"""

from __future__ import annotations

import copy
import getpass
import hashlib
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from hostprocs import alive, die_with_parent, kill_group, kill_pids, listeners, processes, socket_inodes, tail
from tests.ports import free_port

ROOT = Path(__file__).parents[2]
SHIPPED_HEAD_IP, SHIPPED_WORKER_IP = "127.0.0.2", "127.0.0.3"
NODE_IP_PAIRS = [(f"127.0.0.{i}", f"127.0.0.{i + 1}") for i in range(20, 40, 2)]
SSHD = "/usr/sbin/sshd"
USER_RE = re.compile(r"mru[0-9a-f]{8}")  # the throwaway logins, and nothing else, match


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on every address (0.0.0.0), outside Ray's worker ports 10002-19999."""
    out: list[int] = []
    while len(out) < n:
        p = free_port("0.0.0.0")
        if p not in out and not 10002 <= p <= 19999:
            out.append(p)
    return out


def preflight() -> list[str]:
    """What is missing for a real `ray up` here (empty: nothing)."""
    missing = [f"{tool} (Debian: {pkg})" for tool, pkg in ((SSHD, "openssh-server"), ("ssh", "openssh-client"),
                                                           ("rsync", "rsync"), ("ssh-keygen", "openssh-client"),
                                                           ("useradd", "passwd"))
               if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (to create the throwaway login user and run sshd)")
    return missing


def node_ips() -> tuple[str, str]:
    """Two loopback aliases with nothing on port 22 (see the module docstring)."""
    taken = {ip for ip, port, _ in listeners() if port == 22}
    if taken & {"0.0.0.0", "::"}:
        raise RuntimeError("an sshd listens on port 22 of every address (0.0.0.0 or [::]): a private sshd cannot "
                           "bind 127.0.0.x:22 beside it; stop it or bind it to one address")
    for pair in NODE_IP_PAIRS:
        if not taken & set(pair):
            return pair
    raise RuntimeError(f"port 22 is taken on every pair of {NODE_IP_PAIRS[0][0]}-{NODE_IP_PAIRS[-1][1]}: {sorted(taken)}")


def sweep_stale() -> list[str]:
    """Remove what a killed run of this test left (SIGKILL runs no `finally`): for every throwaway user
    whose creating process is gone, its processes and those naming its directory (the `ray` CLI, ssh
    clients and masters), by PID; then the login, Ray's ssh control directories and the files. Users
    of a run still going are left alone. Returns the logins removed."""
    removed = []
    for pw in pwd.getpwall():
        base = Path(pw.pw_dir).parent
        if not USER_RE.fullmatch(pw.pw_name) or not str(base).startswith("/tmp/mru"):
            continue
        try:
            owner = int((base / "owner").read_text())
        except (OSError, ValueError):
            continue
        if alive(owner):
            continue
        for _ in range(5):
            pids = [pid for pid, uid, cmd in processes() if uid == pw.pw_uid or f"{base}/" in cmd]
            if not pids:
                break
            kill_pids(pids)
            time.sleep(0.5)
        try:
            name = yaml.safe_load((base / "cluster.yaml").read_text())["cluster_name"]
        except (OSError, KeyError, TypeError):
            name = None
        if name:
            for d in control_dirs(name, pw.pw_name):
                shutil.rmtree(d, ignore_errors=True)
        subprocess.run(["userdel", pw.pw_name], capture_output=True, timeout=30)
        shutil.rmtree(base, ignore_errors=True)
        removed.append(pw.pw_name)
    return removed


def control_dirs(cluster_name: str, user: str) -> list[Path]:
    """Ray's ssh ControlPath directories for a cluster (hard-coded under /tmp): this login's and the
    throwaway user's (the head's autoscaler reaches the worker over ssh too)."""
    h = hashlib.sha256(cluster_name.encode()).hexdigest()[:10]
    return [Path(f"/tmp/ray_ssh_{hashlib.sha256(u.encode()).hexdigest()[:10]}/{h}") for u in (getpass.getuser(), user)]


class RayUpCluster:
    def __init__(self) -> None:
        problems = preflight()
        if problems:
            raise RuntimeError("cannot run `ray up` here; missing: " + ", ".join(problems) +
                               " — .ci/run installs them")
        self.swept = sweep_stale()
        self.head_ip, self.worker_ip = node_ips()
        self.base = Path(tempfile.mkdtemp(prefix="mru", dir="/tmp"))  # short: Ray's unix sockets live below
        self.base.chmod(0o755)
        (self.base / "owner").write_text(str(os.getpid()))
        tag = secrets.token_hex(4)
        self.user = f"mru{tag}"
        self.cluster_name = f"moeray-rayup-{tag}"
        self.home, self.raytmp = self.base / "h", self.base / "t"
        self.ssh_port = 22
        (self.gcs_port, self.dash_port, self.client_port, self.metrics_head, self.metrics_worker,
         self.serve_port, self.agent_head, self.agent_worker) = _free_ports(8)
        self.sshd: subprocess.Popen | None = None
        self.user_created = False
        self.opened: list[tuple[Path, int]] = []  # directories given search permission for others, old modes
        self.downed = False
        self.calls = 0
        self.cluster_yaml = self.base / "cluster.yaml"
        self.src = self.base / "src"  # where `ray up` runs: the repository root's synced files
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        # `ray up`'s own files (local provider state, ssh control sockets, config cache) stay in base/c
        self.env["RAY_TMPDIR"] = self.env["TMPDIR"] = str(self.base / "c")
        (self.base / "c").mkdir()

    # ---- set-up --------------------------------------------------------------------------------
    def prepare(self, serve_config: dict) -> None:
        self._copy_tree()
        self._make_user()
        self._make_keys()
        self._start_sshd()
        (self.base / "token").write_text(secrets.token_hex(32))
        (self.base / "serve_config.yaml").write_text(yaml.safe_dump(serve_config, sort_keys=False))
        for name in ("token", "serve_config.yaml"):
            (self.base / name).chmod(0o644)
        self.admin_key = secrets.token_hex(32)
        (self.base / "admin_key").write_text(self.admin_key + "\n")
        (self.base / "admin_key").chmod(0o600)  # as the YAML's header makes it
        self.cluster_yaml.write_text(yaml.safe_dump(self.cluster_config(), sort_keys=False))

    def _copy_tree(self) -> None:
        """The repository root as the YAML's rsync sends it (see the module docstring)."""
        shipped = yaml.safe_load((ROOT / "deploy" / "ray-cluster-local.yaml").read_text())
        excludes = [f"--exclude={e}" for e in shipped["rsync_exclude"]]
        filters = [f"--filter=dir-merge,- {f}" for f in shipped["rsync_filter"]]
        self._run("rsync", "-a", *excludes, *filters, f"{ROOT}/", f"{self.src}/", timeout=120)

    def _run(self, *cmd: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True, **kw)

    def _make_user(self) -> None:
        self._run("useradd", "--no-create-home", "--home-dir", str(self.home), "--shell", "/bin/bash",
                  "--password", "*", self.user)  # '*': no password, yet not "locked" for key logins
        self.user_created = True
        pw = pwd.getpwnam(self.user)
        self.uid = pw.pw_uid
        self.home.mkdir()
        self.raytmp.mkdir()
        os.symlink(self._node_venv(), self.home / "moeray-venv")  # what the YAML's pip installs would build
        (self.home / ".bashrc").write_text(
            f"export RAY_TMPDIR={self.raytmp} TMPDIR={self.raytmp}\nexport PYTHONPATH=$HOME/moeray\n")
        for p in (self.home, self.raytmp, self.home / ".bashrc"):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        os.lchown(self.home / "moeray-venv", pw.pw_uid, pw.pw_gid)

    def _node_venv(self) -> Path:
        """A venv the throwaway user can run: a base interpreter it may execute, this venv's packages."""
        want = f"{sys.version_info.major}.{sys.version_info.minor}"
        candidates = [os.path.realpath(sys._base_executable), f"/usr/bin/python{want}"]
        for exe in candidates:
            ok = subprocess.run(["runuser", "-u", self.user, "--", exe, "-c",
                                 "import sys; print('%d.%d' % sys.version_info[:2])"],
                                capture_output=True, text=True, timeout=30)
            if ok.returncode == 0 and ok.stdout.strip() == want:
                break
        else:
            raise RuntimeError(f"no Python {want} that an unprivileged user may run: tried {candidates}")
        venv = self.base / "venv"
        self._run(exe, "-m", "venv", "--without-pip", str(venv))
        site = venv / "lib" / f"python{want}" / "site-packages"
        runner_site = next(p for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages"))
        (site / "runner.pth").write_text(f"import site; site.addsitedir({runner_site!r})\n")
        self._let_others_reach(Path(runner_site))
        for script in ("ray", "serve"):  # the console scripts, with this interpreter
            body = (Path(sys.prefix) / "bin" / script).read_text().split("\n", 1)[1]
            (venv / "bin" / script).write_text(f"#!{venv / 'bin' / 'python'}\n{body}")
            (venv / "bin" / script).chmod(0o755)
        return venv

    def _let_others_reach(self, path: Path) -> None:
        """Search permission for others on each directory down to ``path`` that lacks it (a checkout
        under `mktemp -d` is 0700, and the throwaway user must import this venv's packages); close()
        puts the old modes back."""
        for d in [*reversed(path.parents), path]:
            mode = d.stat().st_mode
            if not mode & stat.S_IXOTH:
                d.chmod(mode | stat.S_IXOTH)
                self.opened.append((d, stat.S_IMODE(mode)))

    def _restore_modes(self) -> None:
        while self.opened:
            d, mode = self.opened.pop()
            d.chmod(mode)

    def _make_keys(self) -> None:
        self._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.base / "key"))
        self._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.base / "hostkey"))
        shutil.copy(self.base / "key.pub", self.base / "authorized_keys")
        (self.base / "authorized_keys").chmod(0o644)

    def _start_sshd(self) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        cfg = self.base / "sshd_config"
        cfg.write_text("\n".join([
            f"ListenAddress {self.head_ip}:{self.ssh_port}", f"ListenAddress {self.worker_ip}:{self.ssh_port}",
            f"HostKey {self.base / 'hostkey'}", f"PidFile {self.base / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.base / 'authorized_keys'}", f"AllowUsers {self.user}",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            "PermitRootLogin no", "X11Forwarding no", "PrintMotd no", "MaxStartups 100", "MaxSessions 100",
            "LogLevel INFO", ""]))
        self.sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.base / "sshd.log", "w"), preexec_fn=die_with_parent)
        deadline = time.monotonic() + 20
        while not self._sshd_listens():
            if self.sshd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start on {self.head_ip}:22 and {self.worker_ip}:22: "
                                   f"{tail(self.base / 'sshd.log', 2000)}")
            time.sleep(0.1)

    def _sshd_listens(self) -> bool:
        """Both node addresses' port 22 are held by this sshd (socket inodes), not by another process."""
        mine = socket_inodes(self.sshd.pid)
        held = {ip for ip, port, inode in listeners() if port == self.ssh_port and inode in mine}
        return {self.head_ip, self.worker_ip} <= held

    # ---- the cluster YAML, as shipped but for the rewrites in the module docstring ---------------------
    def cluster_config(self) -> dict:
        cfg = copy.deepcopy(yaml.safe_load((ROOT / "deploy" / "ray-cluster-local.yaml").read_text()))
        cfg["cluster_name"] = self.cluster_name
        cfg["provider"]["head_ip"] = self.head_ip
        cfg["provider"]["worker_ips"] = [self.worker_ip]
        cfg["auth"] = {"ssh_user": self.user, "ssh_private_key": str(self.base / "key")}
        mounts = cfg["file_mounts"]
        assert mounts.pop("~/.ray/auth_token") == "~/.ray/auth_token", mounts
        mounts["~/.ray/auth_token"] = str(self.base / "token")
        assert mounts.pop("~/.moeray/admin_key") == "~/.moeray/admin_key", mounts
        mounts["~/.moeray/admin_key"] = str(self.base / "admin_key")
        mounts["~/serve_config.yaml"] = str(self.base / "serve_config.yaml")
        cfg["setup_commands"] = [c for c in cfg["setup_commands"] if "pip install" not in c]
        cfg["head_start_ray_commands"] = [self._rewrite(c, head=True) for c in cfg["head_start_ray_commands"]]
        cfg["worker_start_ray_commands"] = [self._rewrite(c, head=False) for c in cfg["worker_start_ray_commands"]]
        return cfg

    def _rewrite(self, command: str, *, head: bool) -> str:
        if "ray start" not in command:
            return command
        out = (command.replace(SHIPPED_HEAD_IP + " ", self.head_ip + " ").replace("--port=6390", f"--port={self.gcs_port}")
               .replace("$RAY_HEAD_IP:6390", f"$RAY_HEAD_IP:{self.gcs_port}")
               .replace("--dashboard-port=8265", f"--dashboard-port={self.dash_port}")
               .replace("--metrics-export-port=8080", f"--metrics-export-port={self.metrics_head}")
               .replace("--metrics-export-port=8081", f"--metrics-export-port={self.metrics_worker}"))
        extra = (f" --ray-client-server-port={self.client_port} --dashboard-agent-listen-port={self.agent_head}"
                 if head else f" --dashboard-agent-listen-port={self.agent_worker}")
        assert out != command or not head, f"nothing rewritten in {command!r}"
        return out + extra

    # ---- ray CLI ---------------------------------------------------------------------------------
    def ray(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        """The `ray` CLI as this login. Its output goes to a log under base; on timeout its process group
        (ssh, rsync children) is killed and the error names the command and quotes the log's end."""
        exe = Path(sys.executable).parent / "ray"
        self.calls += 1
        log = self.base / f"ray-{self.calls:02d}-{args[0]}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([str(exe), *args], cwd=self.src, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                raise AssertionError(f"`ray {args[0]}` ran past {timeout:.0f}s; its output ends:\n{tail(log)}"
                                     f"\n--- sshd log ends:\n{tail(self.base / 'sshd.log', 1500)}") from None
        text = tail(log, 10**7)
        return subprocess.CompletedProcess(proc.args, proc.returncode, text, "")

    def exec_on_head(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.ray("exec", str(self.cluster_yaml), command, timeout=timeout)

    def autoscaler_log(self, n: int = 3000) -> str:
        """The end of the head's autoscaler log (it starts the worker over ssh): what to read when the
        worker does not join."""
        logs = self.raytmp / "ray" / "session_latest" / "logs"
        return "\n".join(f"--- {name} ends:\n{tail(logs / name, n)}" for name in ("monitor.log", "monitor.out"))

    # ---- what is left ------------------------------------------------------------------------------
    def user_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process of the throwaway user."""
        uid = getattr(self, "uid", None)
        return [] if uid is None else [(pid, cmd) for pid, owner, cmd in processes() if owner == uid]

    def ray_processes(self) -> list[tuple[int, str]]:
        """Processes of the throwaway user other than sshd's per-connection ones."""
        return [(pid, cmd) for pid, cmd in self.user_processes() if not cmd.startswith("sshd")]

    def listening_ports(self) -> list[tuple[str, int]]:
        """(ip, port) listening on the two node addresses, or on a port this cluster was given."""
        ours = {self.gcs_port, self.dash_port, self.client_port, self.metrics_head,
                self.metrics_worker, self.serve_port, self.agent_head, self.agent_worker}
        return [(ip, port) for ip, port, _ in listeners() if ip in (self.head_ip, self.worker_ip) or port in ours]

    def control_dirs(self) -> list[Path]:
        return control_dirs(self.cluster_name, self.user)

    def ssh_masters(self) -> list[tuple[int, str]]:
        """ssh connection masters (ControlPersist) still open to this cluster's nodes."""
        dirs = [str(d) for d in self.control_dirs()]
        return [(pid, cmd) for pid, _, cmd in processes() if cmd.startswith("ssh") and any(d in cmd for d in dirs)]

    def stop_sshd(self) -> None:
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait()

    def close(self) -> None:
        """Safety net after a failure, and the end of every run: kill what the throwaway user still runs
        (by PID), close Ray's ssh masters, stop sshd, remove the user and the files. Idempotent; every
        step runs even when an earlier one fails."""
        errors = []
        for step in (self._kill_user_processes, self._close_ssh_masters, self.stop_sshd, self._remove_user,
                     self._restore_modes):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the next steps must still run
                errors.append(f"{step.__name__}: {e!r}")
        shutil.rmtree(self.base, ignore_errors=True)
        if errors:
            raise RuntimeError("cleaning up the `ray up` cluster: " + "; ".join(errors))

    def _kill_user_processes(self) -> None:
        for _ in range(5):
            pids = [pid for pid, _ in self.user_processes()]
            if not pids:
                return
            kill_pids(pids)
            time.sleep(0.5)
        raise RuntimeError(f"processes of {self.user} survive SIGKILL: {self.user_processes()}")

    def _close_ssh_masters(self) -> None:
        kill_pids([pid for pid, _ in self.ssh_masters()], signal.SIGTERM)
        for d in self.control_dirs():
            shutil.rmtree(d, ignore_errors=True)
            try:
                d.parent.rmdir()  # only when empty: it is shared by every cluster of that login
            except OSError:
                pass

    def _remove_user(self) -> None:
        if self.user_created:
            subprocess.run(["userdel", self.user], capture_output=True, timeout=30, check=True)
            self.user_created = False
