"""Joining a multi-process run: `jax.distributed.initialize` from flags or the launcher's environment.

jaxlm has no cluster layer of its own. The same command runs on every node; each process learns
the coordinator (host:port of process 0), the number of processes and its own id from, in order:

  explicit values     `--coordinator`, `--num_processes`, `--process_id` (train and doctor flags)
  JAX_* variables     JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
  SLURM               srun: SLURM_STEP_NUM_TASKS / SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID and
                      the first host of SLURM_STEP_NODELIST (port: JAX_COORDINATOR_PORT, else one
                      derived from SLURM_JOB_ID)
  Open MPI            mpirun: OMPI_COMM_WORLD_SIZE / _RANK / _LOCAL_RANK (coordinator:
                      JAX_COORDINATOR_ADDRESS, else the launcher's host from OMPI_MCA_orte_hnp_uri)
  torchrun-style      WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: set by torchrun,
                      Kubeflow's PyTorchJob and most GPU launchers
  Kubernetes          an Indexed Job or JobSet pod: JOB_COMPLETION_INDEX (set by Kubernetes) as
                      the id, with JAX_NUM_PROCESSES and JAX_COORDINATOR_ADDRESS from the manifest

Explicit values override the environment. Where none of these flags and variables is set at
all, JAX's own cluster detection is the last resort (a Cloud TPU slice, GKE, Kubernetes with
`jax[k8s]`); where they say one process, or nothing is detected, nothing is initialized. When
several processes share a node and the launcher did not already give each its own GPU
(CUDA_VISIBLE_DEVICES with one entry), each process takes the GPU of its local rank.

Before `jax.distributed.initialize` (which aborts the process, with a C++ stack trace, when it cannot
connect), the processes meet at the coordinator's port in a small rendezvous: a process that cannot
reach the coordinator, or a process 0 that does not hear from every process, fails within the
timeout with one line saying which and what to check, instead of hanging or aborting.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxlm.errors import UserError

DEFAULT_TIMEOUT_S = 300.0  # JAX's own default initialization timeout
_HELLO, _GO, _ERROR = "jaxlm-rendezvous", "go", "error"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this process stands in a multi-process run, and where that was learned."""

    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    source: str  # "flags", "JAX_* variables", "SLURM", "Open MPI", "torchrun variables", "Kubernetes"
    local_device_ids: tuple[int, ...] | None = None  # GPUs this process uses; None = all it sees

    def describe(self) -> str:
        gpus = f", local devices {list(self.local_device_ids)}" if self.local_device_ids is not None else ""
        return (f"process {self.process_id} of {self.num_processes} (from {self.source}), "
                f"coordinator {self.coordinator}{gpus}")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UserError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list: 'node[001-004,007],gpu2' -> 'node001'."""
    m = re.match(r"([^,\[]+)(\[([^\],\-]+))?", nodelist.strip())
    if not m:
        raise UserError(f"cannot read the first host of SLURM_STEP_NODELIST={nodelist!r}")
    return m.group(1) + (m.group(3) or "")


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this step on this node, from SLURM_STEP_TASKS_PER_NODE ('4(x2),3') and SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec or "SLURM_NODEID" not in env:
        return None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(env, "SLURM_NODEID")
    return counts[node] if 0 <= node < len(counts) else None


def _one_gpu_each(local_rank: int | None, local_size: int | None, env: Mapping[str, str]) -> tuple[int, ...] | None:
    """Several processes on a node each take the GPU of their local rank, unless the launcher
    already gave each process its own GPU (CUDA_VISIBLE_DEVICES with one entry)."""
    if local_rank is None or not local_size or local_size <= 1:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([v for v in visible.split(",") if v.strip()]) <= 1:
        return None
    return (local_rank,)


def _from_environment(env: Mapping[str, str]) -> tuple[str, dict] | None:
    """(source, {coordinator, num_processes, process_id, local_device_ids}) from a launcher's variables."""
    port = env.get("JAX_COORDINATOR_PORT")
    if "JAX_NUM_PROCESSES" in env and "JAX_PROCESS_ID" in env:
        return "JAX_* variables", dict(
            coordinator=env.get("JAX_COORDINATOR_ADDRESS"), num_processes=_int(env, "JAX_NUM_PROCESSES"),
            process_id=_int(env, "JAX_PROCESS_ID"),
        )
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_STEP_NODELIST" in env):  # inside srun
        count = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        coordinator = env.get("JAX_COORDINATOR_ADDRESS")
        if not coordinator and nodelist:
            job_port = _int(env, "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1) if "SLURM_JOB_ID" in env else None
            coordinator = f"{_first_slurm_host(nodelist)}:{port or job_port}"
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None
        return "SLURM", dict(
            coordinator=coordinator, num_processes=count, process_id=_int(env, "SLURM_PROCID"),
            local_device_ids=_one_gpu_each(local, _slurm_tasks_on_node(env), env),
        )
    if "OMPI_COMM_WORLD_SIZE" in env and "OMPI_COMM_WORLD_RANK" in env:
        coordinator = env.get("JAX_COORDINATOR_ADDRESS")
        uri = env.get("OMPI_MCA_orte_hnp_uri", "")
        m = re.search(r"tcp://([^,:;]+)", uri)
        if not coordinator and m:
            job = int(uri.split(".", 1)[0]) // 2**12 if uri.split(".", 1)[0].isdigit() else 0
            coordinator = f"{m.group(1)}:{port or job % 2**12 + (65535 - 2**12 + 1)}"
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else None
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else None
        return "Open MPI", dict(
            coordinator=coordinator, num_processes=_int(env, "OMPI_COMM_WORLD_SIZE"),
            process_id=_int(env, "OMPI_COMM_WORLD_RANK"), local_device_ids=_one_gpu_each(local, local_size, env),
        )
    if "WORLD_SIZE" in env and "RANK" in env:
        coordinator = env.get("JAX_COORDINATOR_ADDRESS")
        if not coordinator and "MASTER_ADDR" in env:
            coordinator = f"{env['MASTER_ADDR']}:{port or env.get('MASTER_PORT', '29500')}"
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
        local_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
        return "torchrun variables", dict(
            coordinator=coordinator, num_processes=_int(env, "WORLD_SIZE"), process_id=_int(env, "RANK"),
            local_device_ids=_one_gpu_each(local, local_size, env),
        )
    if "JOB_COMPLETION_INDEX" in env:
        return "Kubernetes", dict(
            coordinator=env.get("JAX_COORDINATOR_ADDRESS"),
            num_processes=_int(env, "JAX_NUM_PROCESSES") if "JAX_NUM_PROCESSES" in env else None,
            process_id=_int(env, "JOB_COMPLETION_INDEX"),
        )
    return None


def detect(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
           environ: Mapping[str, str] | None = None) -> Layout | None:
    """This process's layout from explicit values and the environment; None for a single process."""
    env = os.environ if environ is None else environ
    found = _from_environment(env)
    source, values = found if found else ("flags", {})
    explicit = dict(coordinator=coordinator, num_processes=num_processes, process_id=process_id)
    if any(v is not None for v in explicit.values()):
        source = "flags" if not found else f"flags and {source}"
        values.update({k: v for k, v in explicit.items() if v is not None})
    if not values:
        return None
    if values.get("num_processes") == 1 and values.get("process_id") in (None, 0):
        return None
    coordinator = values.get("coordinator") or env.get("JAX_COORDINATOR_ADDRESS")
    missing = [f"--{k}" for k, v in (("coordinator", coordinator), ("num_processes", values.get("num_processes")),
                                      ("process_id", values.get("process_id"))) if v is None]
    if missing:
        raise UserError(
            f"a multi-process run (from {source}) also needs {' and '.join(missing)} "
            f"(or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
        )
    n, pid = int(values["num_processes"]), int(values["process_id"])
    if n < 1 or not 0 <= pid < n:
        raise UserError(f"process id {pid} with {n} processes (from {source}): the id must be in 0..{n - 1}")
    _split_address(coordinator)
    return Layout(coordinator=coordinator, num_processes=n, process_id=pid, source=source,
                  local_device_ids=values.get("local_device_ids"))


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"coordinator address {address!r} is not host:port (e.g. node001:1234 or 10.0.0.1:1234)")
    return host.strip("[]"), int(port)


# ----------------------------------------------------------------------------- rendezvous


def _reply(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall((text + "\n").encode())
    except OSError:
        pass
    conn.close()


def _read_line(conn: socket.socket, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = conn.recv(1024)
        if not chunk:
            break
        data += chunk
        if len(data) > 4096:
            break
    return data.decode(errors="replace").strip()


def _listen(port: int) -> socket.socket:
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False)
        return socket.create_server(("", port))
    except OSError as e:
        raise UserError(
            f"process 0 cannot listen on the coordinator port {port} ({e.strerror or e}); choose a free port "
            f"in --coordinator (or JAX_COORDINATOR_PORT)"
        ) from None


def _connect(host: str, port: int, deadline: float) -> tuple[socket.socket | None, str]:
    """Connect, retrying until the deadline (the coordinator may start later); (socket, last error)."""
    last = "no attempt"
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 5.0), 0.05)), ""
        except socket.gaierror as e:
            last = f"cannot resolve {host!r}: {e.strerror or e}"
        except OSError as e:
            last = e.strerror or str(e) or type(e).__name__
        time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
    return None, last


def _hello(layout: Layout, deadline: float) -> tuple[str | None, str]:
    """Tell process 0 we are here; (its answer, or None on no answer; the last connection error)."""
    host, port = _split_address(layout.coordinator)
    while time.monotonic() < deadline:
        conn, error = _connect(host, port, deadline)
        if conn is None:
            return None, error
        try:
            conn.sendall(f"{_HELLO} {layout.process_id} {layout.num_processes}\n".encode())
            answer = _read_line(conn, deadline)
        except OSError as e:
            answer, error = "", e.strerror or str(e)
        finally:
            conn.close()
        if answer:
            return answer, ""
        time.sleep(0.2)  # no answer: not our rendezvous (yet); try again
    return None, "no answer"


def rendezvous(layout: Layout, timeout_s: float) -> None:
    """Every process meets process 0 at the coordinator's port before JAX connects, so that an
    unreachable coordinator or a missing process is one clear error within `timeout_s`."""
    host, port = _split_address(layout.coordinator)
    deadline = time.monotonic() + timeout_s
    n, me = layout.num_processes, layout.process_id
    if me != 0:
        answer, error = _hello(layout, deadline)
        if answer is None:
            raise UserError(
                f"process {me} of {n} could not reach the coordinator {layout.coordinator} within {timeout_s:g} s "
                f"({error}); check that process 0 runs on that host and port, that every process was given the "
                f"same coordinator and process count, and that no firewall blocks the port"
            )
        if answer.startswith(f"{_HELLO} {_ERROR}"):
            raise UserError(answer[len(f"{_HELLO} {_ERROR}"):].strip())
        return  # "go", or the reply of JAX's service itself (process 0 is past the rendezvous)

    server = _listen(port)
    own: dict[str, str] = {}
    # Process 0 also arrives through the address it was given: proof that it leads back to this host.
    helper = threading.Thread(target=lambda: own.update(zip(("answer", "error"), _hello(layout, deadline))),
                              daemon=True)
    helper.start()
    arrived: dict[int, socket.socket] = {}
    problem = None
    try:
        while len(arrived) < n and problem is None and time.monotonic() < deadline:
            server.settimeout(max(min(deadline - time.monotonic(), 1.0), 0.01))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            try:
                words = _read_line(conn, min(deadline, time.monotonic() + 10)).split()
            except OSError:
                conn.close()
                continue
            if len(words) != 3 or words[0] != _HELLO or not words[1].isdigit() or not words[2].isdigit():
                conn.close()
                continue
            pid, count = int(words[1]), int(words[2])
            if count != n:
                problem = (f"process {pid} was started with {count} processes but process 0 with {n}; give every "
                           f"process the same --num_processes")
                _reply(conn, f"{_HELLO} {_ERROR} {problem}")
            elif pid in arrived:
                problem = f"two processes have the id {pid}; give each process its own --process_id in 0..{n - 1}"
                _reply(conn, f"{_HELLO} {_ERROR} {problem}")
            else:
                arrived[pid] = conn
        if problem is None and len(arrived) < n:
            missing = sorted(set(range(n)) - set(arrived))
            if missing == [0] or 0 in missing:
                helper.join(timeout=1)
                problem = (
                    f"the coordinator address {layout.coordinator} does not lead back to process 0's host "
                    f"({own.get('error') or 'no connection'}); process 0 must run on the host that address names"
                )
            else:
                problem = (
                    f"process 0 of {n}: {len(missing)} process(es) did not reach the coordinator "
                    f"{layout.coordinator} within {timeout_s:g} s (missing ids: "
                    f"{', '.join(map(str, missing[:10]))}{', ...' if len(missing) > 10 else ''}); start the same "
                    f"command on every node with the same coordinator and process count"
                )
        for conn in arrived.values():
            _reply(conn, f"{_HELLO} {_ERROR} {problem}" if problem else f"{_HELLO} {_GO}")
    finally:
        server.close()
    helper.join(timeout=5)
    if problem:
        raise UserError(problem)


# ----------------------------------------------------------------------------- initialization


def is_initialized() -> bool:
    return jax.distributed.is_initialized()


def initialize(layout: Layout | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Layout | None:
    """Rendezvous, then `jax.distributed.initialize` with the layout; a no-op for None (one process)
    or when JAX is already initialized. Call before anything asks JAX for its devices."""
    if layout is None or is_initialized():
        return layout
    started = time.monotonic()
    rendezvous(layout, timeout_s)
    remaining = max(timeout_s - (time.monotonic() - started), 30.0)
    jax.distributed.initialize(
        coordinator_address=layout.coordinator, num_processes=layout.num_processes, process_id=layout.process_id,
        local_device_ids=list(layout.local_device_ids) if layout.local_device_ids is not None else None,
        cluster_detection_method="deactivate", initialization_timeout=int(remaining),
    )
    return layout


def initialize_from(coordinator: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Layout | None:
    """`detect` then `initialize`."""
    return initialize(detect(coordinator, num_processes, process_id), timeout_s)


# Variables of the launchers `detect` reads. Where any is set (or a flag is given), jaxlm's reading is
# final and JAX's detection is not asked: it reads SLURM and Open MPI differently (SLURM_NTASKS in an
# sbatch script run without srun, say) and would wait for processes that never start.
_LAUNCHER_VARIABLES = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE",
                       "OMPI_MCA_orte_hnp_uri", "WORLD_SIZE", "JOB_COMPLETION_INDEX")
# `jax.distributed.initialize()`'s words (jax 0.10.2, jax/_src/distributed.py), the only public way to
# ask JAX's cluster detection: no cluster detected (one process, as on a laptop), and JAX has already
# started its backends in this process (a notebook, a test: it stays one process).
_NO_CLUSTER = "coordinator_address should be defined"
_TOO_LATE = "must be called before any JAX"


def join(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
         timeout_s: float = DEFAULT_TIMEOUT_S, environ: Mapping[str, str] | None = None) -> str | None:
    """Join a multi-process run, as `python -m jaxlm.train` and `python -m jaxlm.doctor` do: from the
    flags or a launcher jaxlm knows (`detect`: SLURM, Open MPI, torchrun-style variables, ...), else,
    where no launcher is seen at all, by JAX's own cluster detection (Cloud TPU slices, GKE, ...).
    Returns a line describing the layout, or None for a single process. Call before anything asks
    JAX for its devices."""
    env = os.environ if environ is None else environ
    layout = initialize(detect(coordinator, num_processes, process_id, env), timeout_s)
    if layout is not None:
        return layout.describe()
    if jax.distributed.is_initialized():
        return f"process {jax.process_index()} of {jax.process_count()} (initialized before jaxlm)"
    if any(v is not None for v in (coordinator, num_processes, process_id)) or any(v in env for v in _LAUNCHER_VARIABLES):
        return None  # a launcher jaxlm knows, or the flags, say one process
    return _join_by_jax_detection(timeout_s)


def _join_by_jax_detection(timeout_s: float) -> str | None:
    """`jax.distributed.initialize()` with no arguments: JAX's own cluster detection. None (quietly,
    at no cost) where it detects no cluster; one line where it cannot join what it detected."""
    try:
        with warnings.catch_warnings():  # its Kubernetes detection warns, without the `kubernetes`
            warnings.simplefilter("ignore")  # package, about a bootstrap jaxlm does not need
            jax.distributed.initialize(initialization_timeout=int(timeout_s))
    except Exception as e:  # noqa: BLE001 -- whatever the detected cluster's bootstrap raised
        text = str(e).strip()
        if (isinstance(e, ValueError) and _NO_CLUSTER in text) or (isinstance(e, RuntimeError) and _TOO_LATE in text):
            return None
        first = text.splitlines()[0] if text else type(e).__name__
        raise UserError(
            f"JAX's own cluster detection (tried as no launcher jaxlm knows was found) could not join a run "
            f"({first}); give the layout with --coordinator, --num_processes and --process_id, or "
            f"--num_processes=1 to run as one process"
        ) from None
    return f"process {jax.process_index()} of {jax.process_count()} (from JAX's cluster detection)"


# ----------------------------------------------------------------------------- agreeing on a step


def _client():
    """The coordination service's client (key-value store, barriers): JAX exposes none publicly,
    Orbax does, and keeps it working across JAX versions."""
    import orbax.checkpoint as ocp  # local import: heavy (orbax, 0.2 s; the doctor imports this module)

    return ocp.multihost.get_jax_distributed_client()


class StepAgreement:
    """Agree, across processes and without a device round trip, on the step at which to act on an
    event that one process saw: a signal that reached only it, or its clock saying a save is due.

    The process that sees the event proposes "act after step s + LAG" through the coordination
    service's key-value store; the first proposal wins, and every process reads it at each step
    boundary. Two steps of lag are enough: a process at the boundary of step t has waited for step
    t - 1's metrics, and step t - 1 ran a collective with every process, so every other process has
    passed the boundary of step t - 2 and anything it proposed there is visible. One process
    acts at once (no lag, no store).
    """

    LAG = 2

    def __init__(self, prefix: str = "jaxlm/agreement"):
        self.client = _client() if jax.process_count() > 1 else None
        self.prefix = prefix
        self.rounds: dict[str, int] = {}  # how many times each event was acted on (a repeating event's round)
        self.proposals: dict[str, int] = {}  # key -> the step to act at
        self._read_at: int | None = None

    def _key(self, event: str) -> str:
        return f"{self.prefix}/{event}/{self.rounds.get(event, 0)}"

    def propose(self, event: str, step: int) -> None:
        """This process saw `event` at the boundary of `step`."""
        if self.client is None:
            self.proposals.setdefault(self._key(event), step)
            return
        try:
            self.client.key_value_set(self._key(event), str(step + self.LAG), allow_overwrite=False)
        except Exception:  # noqa: BLE001 -- another process proposed first: its step stands
            pass
        self._read_at = None

    def due(self, event: str, step: int) -> bool:
        """Whether every process acts on `event` at the boundary of `step` (then the event's next
        round begins). One read of the store per step, whatever the number of events."""
        if self.client is not None and self._read_at != step:
            self.proposals = {k: int(v) for k, v in self.client.key_value_dir_get(self.prefix)}
            self._read_at = step
        at = self.proposals.get(self._key(event))
        if at is None or step < at:
            return False
        self.rounds[event] = self.rounds.get(event, 0) + 1
        return True


def all_values(value: int) -> list[int]:
    """`value` from every process, in process order (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return [int(value)]
    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.array([value], np.int64))).ravel()]


def barrier(name: str, timeout_s: float = 600.0) -> None:
    """Wait until every process reaches `name` (a no-op for one process)."""
    if jax.process_count() > 1:
        _client().wait_at_barrier(f"jaxlm/{name}", int(timeout_s * 1000))


FLAGS = {"coordinator": str, "num_processes": int, "process_id": int, "distributed_timeout_s": float}


def pop_flags(argv: list[str]) -> tuple[list[str], dict]:
    """Split `--coordinator=host:port --num_processes=N --process_id=I --distributed_timeout_s=S`
    off a command line: (the other arguments, keyword arguments for `join`)."""
    rest, values = [], {}
    for arg in argv:
        name, sep, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in FLAGS:
            if not sep:
                raise UserError(f"--{name} needs a value: --{name}=...")
            try:
                values[name] = FLAGS[name](value)
            except ValueError:
                expected = "a number" if FLAGS[name] is not str else "host:port"
                raise UserError(f"--{name}={value}: expected {expected}") from None
        else:
            rest.append(arg)
    if "distributed_timeout_s" in values:
        values["timeout_s"] = values.pop("distributed_timeout_s")
    return rest, values
