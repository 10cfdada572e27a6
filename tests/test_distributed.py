"""Multi-process runs: real processes on localhost (CPU devices, gloo collectives) through the real CLI.

Two processes with 4 CPU devices each must train exactly like one process with 8: the same global
batches (data.shards), the same losses; checkpoints move between process counts; a signal to one
process stops all of them at one step with one checkpoint; a coordinator nobody answers at is one
clear line, not a hang.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import floats
import pytest

from helpers import xla_flags
from jaxlm import axes, distributed
from jaxlm.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- layout detection


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # sbatch step, no srun
        ({"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"},
         ("h0:1234", 4, 3, "JAX_* variables", None)),
        ({"SLURM_JOB_ID": "4100", "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
          "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_STEP_NODELIST": "gpu[017-018]"},
         ("gpu017:61444", 16, 9, "SLURM", (1,))),  # one process per GPU: each takes its local rank's GPU
        ({"SLURM_JOB_ID": "4100", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
          "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "a1,b2",
          "JAX_COORDINATOR_PORT": "3389"},
         ("a1:3389", 2, 1, "SLURM", None)),  # one process per node: all its GPUs
        ({"SLURM_JOB_ID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3", "SLURM_LOCALID": "3",
          "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_STEP_NODELIST": "n1",
          "CUDA_VISIBLE_DEVICES": "3"},
         ("n1:61441", 8, 3, "SLURM", None)),  # --gpus-per-task already gave each process one GPU
        ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "m",
          "MASTER_PORT": "29500"},
         ("m:29500", 4, 2, "torchrun variables", (0,))),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"},
         ("10.0.0.1:1234", 2, 1, "Open MPI", None)),
        ({"JOB_COMPLETION_INDEX": "5", "JAX_NUM_PROCESSES": "8", "JAX_COORDINATOR_ADDRESS": "train-w-0-0.train:1234"},
         ("train-w-0-0.train:1234", 8, 5, "Kubernetes", None)),
    ],
)
def test_the_layout_comes_from_the_launchers_environment(env, expected):
    layout = distributed.detect(environ=env)
    got = None if layout is None else (
        layout.coordinator, layout.num_processes, layout.process_id, layout.source, layout.local_device_ids)
    assert got == expected


def test_flags_override_the_environment_and_missing_values_are_one_line():
    env = {"WORLD_SIZE": "4", "RANK": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"}
    layout = distributed.detect(coordinator="c:9", process_id=3, environ=env)
    assert (layout.coordinator, layout.num_processes, layout.process_id) == ("c:9", 4, 3)
    assert layout.source == "flags and torchrun variables"
    assert distributed.detect(num_processes=1, environ={}) is None
    with pytest.raises(UserError, match="also needs --coordinator"):
        distributed.detect(num_processes=2, process_id=0, environ={})
    with pytest.raises(UserError, match="must be in 0..1"):
        distributed.detect("h:1", 2, 2, environ={})
    with pytest.raises(UserError, match="is not host:port"):
        distributed.detect("h", 2, 0, environ={})
    rest, values = distributed.pop_flags(["--config=x.py", "--coordinator=h:1", "--process_id=1",
                                          "--distributed_timeout_s=5", "--config.run.steps=3"])
    assert rest == ["--config=x.py", "--config.run.steps=3"]
    assert values == {"coordinator": "h:1", "process_id": 1, "timeout_s": 5.0}


# ----------------------------------------------------------------------------- real processes

# A small model, so the four compiles (1 x 8, 2 x 4, each process) fit the default suite.
SMALL = [
    "--config=configs/tiny.py", "--config.model.vocab_size=512", "--config.model.d_model=64",
    "--config.model.n_layers=2", "--config.model.n_heads=4", "--config.model.n_kv_heads=2",
    "--config.model.mlp_dim=128", "--config.data.seq_len=64", "--config.data.global_batch_size=8",
    "--config.data.builtin_max_bytes=300000", "--config.data.val_tokens=1024", "--config.run.log_every=1",
    "--config.run.eval_every=0", "--config.checkpoint.every_steps=1000", "--config.metrics.progress=lines",
    "--config.optim.schedule=constant", "--config.optim.warmup_steps=0",  # the same rates for any run.steps
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv, devices, coordinator=None, num_processes=1, process_id=0):
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"))
    layout = [] if coordinator is None else [
        f"--coordinator={coordinator}", f"--num_processes={num_processes}", f"--process_id={process_id}"]
    return subprocess.Popen([sys.executable, "-m", "jaxlm.train", *argv, *layout], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_all(argv, processes):
    """`processes` processes sharing 8 CPU devices equally, on a free localhost port."""
    if processes == 1:
        return [start(argv, 8)]
    coordinator = f"127.0.0.1:{free_port()}"
    return [start(argv, 8 // processes, coordinator, processes, i) for i in range(processes)]


def finish(procs, timeout=900):
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append((proc.returncode, out, err))
    return results


def train(argv, processes):
    results = finish(start_all(argv, processes))
    for code, _out, err in results:
        assert code == 0, err[-3000:]
    return results


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def close(got, want, rtol=1e-4):
    """Per-step losses agree: collectives over 2 processes sum in another order than over 1."""
    assert sorted(got) == sorted(want)
    for step in want:
        assert abs(got[step] - want[step]) <= rtol * abs(want[step]), (step, got[step], want[step])


def args(tmp, name, steps, *extra):
    return [*SMALL, f"--config.run.output_dir={tmp}", f"--config.run.name={name}", f"--config.run.steps={steps}",
            f"--config.data.cache_dir={tmp / 'cache'}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 8 devices, the global batch read as 2 data shards (what 2 processes read)."""
    tmp = tmp_path_factory.mktemp("distributed")
    train(args(tmp, "one", 8, "--config.data.shards=2"), 1)
    return tmp, losses(tmp / "one")


@pytest.mark.slow  # ~70 s with its reference run; keeps the default suite under 10 minutes on 2 cores
def test_two_processes_of_4_devices_train_like_one_process_of_8(reference):
    tmp, want = reference
    results = train(args(tmp, "two", 4), 2)
    close(losses(tmp / "two"), {s: want[s] for s in range(1, 5)})
    (_, out0, _), (_, out1, _) = results
    assert "process 0 of 2 (from flags)" in out0 and "2 data shard(s), each process reads 1" in out0
    assert "step " not in out1 and "jaxlm:" not in out1  # only process 0 logs
    assert len((tmp / "two" / "metrics.jsonl").read_text().splitlines()) == 4  # written once per step
    meta = json.loads((tmp / "two" / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert meta["data_shards"] == 2 and meta["process_count"] == 2
    assert sorted(p.name for p in (tmp / "two" / "checkpoints" / "4" / "data").glob("*.json")) == [
        "process_0-of-2.json", "process_1-of-2.json"]
    # the run's energy is both processes' (summed at each logging step, a collective) and in the checkpoint
    summary = json.loads((tmp / "two" / "summary.json").read_text())
    assert summary["energy_j"] > 0 and summary["energy_source"] in ("rapl", "estimate")
    assert 0 < meta["energy_j"] <= summary["energy_j"]


@pytest.mark.slow
def test_a_checkpoint_of_2_processes_resumes_on_1_and_one_of_1_resumes_on_2(reference):
    """2 processes to step 4, then 1 process to step 8 (data.shards=0 keeps the checkpoint's 2 data
    shards); 1 process to step 4, then 2 processes on a hybrid mesh to 8. Both equal the
    uninterrupted run on 1 process."""
    tmp, want = reference
    train(args(tmp, "two-then-one", 4), 2)
    train(args(tmp, "two-then-one", 8), 1)
    close(losses(tmp / "two-then-one"), want)
    train(args(tmp, "one-then-two", 4, "--config.data.shards=2"), 1)
    # ... on a hybrid mesh: fsdp within each process, data across the two (one key, mesh.hybrid).
    results = train(args(tmp, "one-then-two", 8, "--config.data.shards=2", "--config.mesh.hybrid=process"), 2)
    assert "resuming from step 4" in results[0][1]
    assert f"mesh {axes.describe(axes.shape_of(data=2, fsdp=4))}" in results[0][1]
    close(losses(tmp / "one-then-two"), want)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step_with_one_checkpoint(tmp_path):
    """Process 1 alone gets SIGTERM; both stop at the same step boundary and save it together.
    Saves every 0.6 s by process 0's clock also happen at steps both processes agree on."""
    argv = args(tmp_path, "stopped", 200, "--config.checkpoint.every_minutes=0.01", "--config.checkpoint.keep_last=100")
    procs = start_all(argv, 2)
    seen = []
    for line in procs[0].stdout:  # process 0 logs; the signal goes to process 1 only
        seen.append(line)
        if line.startswith("step      3/"):
            procs[1].send_signal(signal.SIGTERM)
            break
    (code0, out0, err0), (code1, _, err1) = finish(procs, timeout=600)
    assert (code0, code1) == (75, 75), err0[-2000:] + err1[-2000:]
    step1 = int(err1.split("SIGTERM at step ")[1].split(";")[0])
    step0 = int(err0.split("a stop signal to another process at step ")[1].split(";")[0])
    assert step0 == step1 and 3 < step1 < 200
    checkpoints = sorted(int(p.name) for p in (tmp_path / "stopped" / "checkpoints").iterdir() if p.name.isdigit())
    assert checkpoints[-1] == step1
    for step in checkpoints:  # each saved by both processes at once
        files = sorted(p.name for p in (tmp_path / "stopped" / "checkpoints" / str(step) / "data").glob("*.json"))
        assert files == ["process_0-of-2.json", "process_1-of-2.json"]
    logged = losses(tmp_path / "stopped")
    assert sorted(logged) == list(range(1, step1 + 1))
    # Resumed on one process (the checkpoint's two data shards kept), it continues from that step.
    results = train(args(tmp_path, "stopped", step1 + 2), 1)
    assert f"resuming from step {step1}" in results[0][1]
    assert sorted(losses(tmp_path / "stopped")) == list(range(1, step1 + 3))


def test_an_unreachable_coordinator_is_one_line_within_the_timeout(tmp_path):
    """Process 1 of 2 with nobody at the coordinator's address: exit 2 with one line after the
    3 s it was given, not a hang and not JAX's abort with a stack trace."""
    argv = [*args(tmp_path, "lost", 2), "--distributed_timeout_s=3"]
    proc = start(argv, 4, f"127.0.0.1:{free_port()}", 2, 1)
    (code, out, err), = finish([proc], timeout=120)
    assert code == 2, err[-2000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("jaxlm: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "process 1 of 2 could not reach the coordinator 127.0.0.1:" in lines[0]
    assert "within 3 s (Connection refused)" in lines[0]
    assert not (tmp_path / "lost").exists()


def test_doctor_joins_the_run_and_shows_the_process_layout():
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxlm.doctor", "--expect=cpu", "--matmul_size=128", f"--coordinator={coordinator}",
         "--num_processes=2", f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    (code0, out0, err0), (code1, out1, err1) = finish(procs, timeout=300)
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    assert "devices          4 global, 2 local" in out0
    assert "processes        2 on 1 host(s), this is process 0; devices per process {'0': 2, '1': 2}" in out0
    assert f"layout           process 0 of 2 (from flags), coordinator {coordinator}" in out0
    assert out0.strip().splitlines()[-1].startswith("jaxlm doctor: OK (jax ")
    assert "2 processes on 1 host" in out0.strip().splitlines()[-1]
    assert "[process 1, " in err1 and "jaxlm doctor: OK" in err1 and "jaxlm doctor" not in out1


def test_any_process_count_reads_the_same_global_batches_and_resumes_them():
    """The data shards' streams, read whole by one process or in row blocks by several (a block may
    span two shards, or take part of one), give the same global batches, and positions saved by one
    layout resume in another."""
    import numpy as np

    from jaxlm.data import loader, pipeline

    rng = np.random.default_rng(0)
    docs = [rng.integers(4, 100, rng.integers(5, 60)).astype(np.int32) for _ in range(300)]

    def stream(shards, rows):
        return loader.ShardedStream(
            lambda j: iter(pipeline.make_train_dataset(docs, seq_len=16, batch_size=8 // shards, seed=1,
                                                       shard_index=j, shard_count=shards)), shards, rows, 8)

    for shards in (1, 4):
        whole = stream(shards, slice(0, 8))
        want = [next(whole) for _ in range(3)]
        for blocks in ([slice(0, 4), slice(4, 8)], [slice(0, 3), slice(3, 8)]):  # 2 processes; uneven spans too
            parts = [stream(shards, rows) for rows in blocks]
            for batch in want:
                got = [next(p) for p in parts]
                for key in batch:
                    # the global batch's rows, read in blocks (tokens, and loss weights of 0 and 1)
                    floats.identical(np.concatenate([g[key] for g in got]), batch[key], why=floats.MOVED)
        # Positions saved by the two processes resume in one process, and one's in two.
        states = [p.get_state() for p in parts]
        one = stream(shards, slice(0, 8))
        one.set_states(states)
        after = next(whole)
        np.testing.assert_array_equal(next(one)["inputs"], after["inputs"])
        half = stream(shards, slice(4, 8))
        half.set_states([whole.get_state()])
        np.testing.assert_array_equal(next(half)["inputs"], next(whole)["inputs"][4:8])
    with pytest.raises(UserError, match="has 4 data shards but this run reads 2"):
        stream(2, slice(0, 8)).set_states(states)


@pytest.mark.slow  # ~50 s: two runs
def test_micro_batches_over_two_processes_train_like_one_process(tmp_path):
    """Each data replica accumulates its own micro-batches' gradient (one reduction per step), also
    when the replicas are different processes: data=2 x fsdp=4, 2 micro-batches, 1 vs 2 processes."""
    extra = ["--config.data.global_batch_size=16", "--config.mesh.data=2", "--config.mesh.fsdp=4",
             "--config.optim.micro_batches=2", "--config.data.shards=2"]
    train(args(tmp_path, "one", 4, *extra), 1)
    train(args(tmp_path, "two", 4, *extra), 2)
    close(losses(tmp_path / "two"), losses(tmp_path / "one"))


@pytest.mark.slow  # ~50 s: two runs
def test_the_expert_axis_over_two_processes_splits_the_rows_like_one_process(tmp_path):
    """expert=8 spans both processes (data parallelism for this dense model): each process reads and
    holds its own block of rows, half the batch, and the losses equal one process's."""
    extra = ["--config.data.global_batch_size=16", "--config.mesh.fsdp=1", "--config.mesh.expert=8",
             "--config.data.shards=2"]
    train(args(tmp_path, "one", 4, *extra), 1)
    results = train(args(tmp_path, "two", 4, *extra), 2)
    close(losses(tmp_path / "two"), losses(tmp_path / "one"))
    out = results[0][1]
    assert f"mesh {axes.describe(axes.shape_of(expert=8))}" in out, out[-2000:]
    assert "2 data shard(s), each process reads 1" in out, out[-2000:]  # its own half of the batch


@pytest.mark.slow  # ~60 s: two runs
def test_a_pipelined_run_over_two_processes_trains_like_one_process(tmp_path):
    """Pipeline stages across processes (issue 22): stage=2 x fsdp=4 with the stage axis spanning the two
    processes, so the activations handed between stages cross a process boundary; the losses equal
    one process's. Both processes feed the same rows (the batch is replicated over the stages)."""
    extra = ["--config.data.global_batch_size=16", "--config.mesh.stage=2", "--config.mesh.fsdp=4",
             "--config.model.scan_layers=true", "--config.data.shards=2"]
    train(args(tmp_path, "one", 4, *extra), 1)
    results = train(args(tmp_path, "two", 4, *extra), 2)
    close(losses(tmp_path / "two"), losses(tmp_path / "one"))
    out = results[0][1]
    assert f"mesh {axes.describe(axes.shape_of(stage=2, fsdp=4))}" in out, out[-2000:]
    assert "2 data shard(s), each process reads 2" in out, out[-2000:]  # the whole batch on each process


JAX_DETECTS_A_CLUSTER = """
import sys
from jax._src import clusters  # only here: a cluster kind jaxlm does not know, as JAX registers its own

MODE = "broken"


class Pod(clusters.ClusterEnv):
    name = "test-pod"
    opt_in_only_method = False

    @classmethod
    def is_env_present(cls): return True
    @classmethod
    def get_coordinator_address(cls, timeout_secs, override_coordinator_port=None):
        if MODE == "broken":
            raise RuntimeError("the pod's API said no\\nsecond line")
        return sys.argv[1]
    @classmethod
    def get_process_count(cls): return 1
    @classmethod
    def get_process_id(cls): return 0
    @classmethod
    def get_local_process_id(cls): return None


import jax
from jaxlm import axes, distributed
from jaxlm.errors import UserError

try:  # a cluster JAX detects but cannot join: one line, and a way out
    distributed.join()
except UserError as e:
    print(e)
MODE = "ok"
# A launcher jaxlm knows that says one process (an sbatch script without srun), or the flags: JAX is not asked.
print(distributed.join(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}),
      distributed.join(num_processes=1, environ={}), jax.distributed.is_initialized())
print(distributed.join(environ={}))
print(jax.distributed.is_initialized(), jax.process_count())

# The coordination service's client, as StepAgreement and barrier use it (through Orbax's public accessor).
client = distributed._client()
agreement = distributed.StepAgreement(prefix="jaxlm/test")
agreement.client = client
agreement.propose("stop", 5)
agreement.propose("stop", 9)  # a later proposal does not move the agreed step
print([agreement.due("stop", step) for step in (6, 7)], sorted(client.key_value_dir_get("jaxlm/test")))
client.wait_at_barrier("jaxlm/test-barrier", 10_000)
print("barrier passed")
"""


def test_a_cluster_only_jax_detects_is_joined_through_jaxs_detection():
    """jaxlm's own detection (flags, SLURM, Open MPI, torchrun variables) finds nothing: JAX's own
    cluster detection (TPU slices, GKE, ...) is the last resort, for the trainer and the doctor alike;
    a cluster it detects but cannot join is one line; a launcher jaxlm knows that says one process is
    not second-guessed; with no cluster at all it is one process, quietly. Then the coordination
    service's key-value store and barrier, which StepAgreement and barrier use, work through the client."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "JAX_")) and k not in distributed._LAUNCHER_VARIABLES}
    joined = subprocess.run([sys.executable, "-c", JAX_DETECTS_A_CLUSTER, f"127.0.0.1:{free_port()}"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert joined.returncode == 0, joined.stderr[-2000:]
    assert joined.stdout.splitlines() == [
        "JAX's own cluster detection (tried as no launcher jaxlm knows was found) could not join a run (the pod's "
        "API said no); give the layout with --coordinator, --num_processes and --process_id, or --num_processes=1 "
        "to run as one process",
        "None None False",
        "process 0 of 1 (from JAX's cluster detection)",
        "True 1",
        "[False, True] [('jaxlm/test/stop/0', '7')]",
        "barrier passed",
    ]
    alone = subprocess.run([sys.executable, "-c", "from jaxlm import distributed; import jax; "
                            "print(distributed.join(), jax.distributed.is_initialized()); "
                            "jax.numpy.ones(2).block_until_ready(); print(distributed.join())"],  # too late: alone
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0 and alone.stdout.split() == ["None", "False", "None"] and alone.stderr == "", (
        alone.stdout + alone.stderr)
