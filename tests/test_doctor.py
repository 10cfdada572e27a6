"""`python -m jaxlm.doctor`: runs on CPU and reports it; a missing GPU is a clear failure."""

import json
import os
import shutil
import subprocess
import sys

import jax

from jaxlm import doctor

# A machine whose nvidia-smi lists GPUs would (rightly) call JAX_PLATFORMS=cpu a problem; these
# tests check the CPU on purpose, so they say so there.
CPU_ON_PURPOSE = ["--expect=cpu"] if shutil.which("nvidia-smi") else []


def run_doctor(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # conftest's 8 fake devices come along in XLA_FLAGS
    return subprocess.run(
        [sys.executable, "-m", "jaxlm.doctor", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_doctor_runs_on_cpu_and_reports_it():
    result = run_doctor("--json", *CPU_ON_PURPOSE)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["findings"] == []
    assert report["versions"]["jax"] == jax.__version__
    assert report["devices"]["platform"] == "cpu"
    assert report["devices"]["count"] == jax.device_count() == 8
    assert report["devices"]["process_count"] == 1
    assert report["attention"]["status"] == "not applicable (no GPU)"
    matmul = report["matmul"]
    assert matmul["tflops"] > 0 and matmul["runs"] >= 2
    assert matmul["peak_tflops"] is None  # no peak for a CPU, so no made-up fraction
    assert matmul["relative_error"] < 1e-2
    assert len(matmul["per_device_relative_error"]) == 8
    assert report["verdict"].startswith("jaxlm doctor: OK (")


def test_doctor_prints_a_readable_report_ending_in_the_verdict():
    result = run_doctor(*CPU_ON_PURPOSE)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith(f"jaxlm doctor: OK (jax {jax.__version__}, 8 cpu devices, bf16 matmul ")
    assert "TFLOP/s" in lines[-1]
    text = "\n".join(lines)
    for expected in ("jaxlib", "cudnn", "platform         cpu", "8 global, 8 local", "peak unknown"):
        assert expected in text


def test_expect_gpu_on_a_cpu_machine_fails_with_one_clear_line():
    result = run_doctor("--expect=gpu", "--matmul_size=128")
    assert result.returncode == 1
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("jaxlm doctor: PROBLEM: expected a GPU (--expect=gpu) but JAX sees only cpu")
    assert result.stdout.count("PROBLEM") == 1
    assert "Traceback" not in result.stderr


def test_platform_findings_name_the_cause_and_the_fix():
    def messages(**kw):
        args = dict(backend="cpu", gpus_listed=2, jax_platforms="", plugins={}, jaxlib="0.10.2", expect="auto")
        return [(level, message) for level, message in doctor.platform_findings(**{**args, **kw})]

    [(level, message)] = messages()
    assert level == "fail" and "nvidia-smi lists 2 GPU(s) but JAX sees only cpu" in message
    assert "pip install 'jax[cuda12]'" in message
    [(_, message)] = messages(jax_platforms="cpu", plugins={"jax-cuda12-plugin": "0.10.2"})
    assert "JAX_PLATFORMS=cpu hides them" in message
    [(_, message)] = messages(plugins={"jax-cuda12-plugin": "0.10.2"}, backend_error="CUDA driver too old")
    assert "the CUDA plugin did not start (CUDA driver too old)" in message
    [(_, message)] = messages(backend="gpu", plugins={"jax-cuda12-plugin": "0.9.0"})
    assert "jax-cuda12-plugin 0.9.0 does not match jaxlib 0.10.2" in message
    assert messages(backend="gpu", plugins={"jax-cuda12-plugin": "0.10.2"}) == []
    assert messages(jax_platforms="cpu", expect="cpu") == []  # checking the CPU on purpose
    assert messages(gpus_listed=0) == []  # no GPU here and none expected
    [(_, message)] = messages(gpus_listed=0, expect="gpu")
    assert message.startswith("expected a GPU (--expect=gpu) but JAX sees only cpu and nvidia-smi lists no GPU")


def test_cuda_and_cudnn_version_numbers_read_as_their_releases():
    assert doctor._cuda_number(12080) == "12.8" and doctor._cuda_number(13000) == "13.0"
    assert doctor._cudnn_number(91100) == "9.11.0" and doctor._cudnn_number(8907) == "8.9.7"
    assert doctor._cuda_number(None) == doctor._cudnn_number(0) == "unknown"


def test_the_attention_comparison_the_gpu_check_uses_measures_real_differences():
    # On a GPU the doctor compares cuDNN with XLA this way; here XLA's bf16 kernel against the
    # float32 reference shows the comparison sees bf16 rounding (~3e-3) and stays under its tolerance.
    errors = doctor.attention_errors(jax.devices()[0], "xla", reference="float32")
    assert set(errors) == {"out", "dq", "dk", "dv"}
    assert all(0 < e < doctor.ATTENTION_TOLERANCE / 5 for e in errors.values()), errors


def test_a_gpu_memory_limit_well_under_the_card_says_how_to_raise_it():
    from jaxlm import doctor

    gib = 2**30
    note = doctor.memory_share_note(int(59.4 * gib), int(79.6 * gib))  # jax's default 75% on an H100 80GB
    assert note.startswith(" of the card's 79.6 GiB: jax holds 75%") and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in note
    assert doctor.memory_share_note(int(71.6 * gib), int(79.6 * gib)) == ""  # 90%: nothing to say
    assert doctor.memory_share_note(None, int(79.6 * gib)) == "" and doctor.memory_share_note(int(59.4 * gib), None) == ""
