"""The documentation stays true to the code: the generated configuration reference is current, every
relative link resolves, and the README stays a ten-minute read."""

from __future__ import annotations

import pathlib
import re

from jaxlm import config_reference, overrides

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_config_reference_is_generated_from_the_current_config():
    assert config_reference.OUTPUT.read_text() == config_reference.render(), (
        "docs/config-reference.md is out of date: run python -m jaxlm.config_reference")


def test_the_keys_file_train_checks_before_jax_is_the_current_config():
    assert overrides.KEYS_FILE.read_text() == config_reference.render_keys(), (
        "jaxlm/config_keys.json is out of date: run python -m jaxlm.config_reference")


def test_the_reference_documents_every_key():
    text = config_reference.render()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows and all(not line.endswith("|  |") for line in rows), [r for r in rows if r.endswith("|  |")]


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_is_short_and_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    guides = {p.name for p in (ROOT / "docs").glob("*.md")}
    linked = {pathlib.Path(t).name for t in LINK.findall(readme) if t.startswith("docs/")}
    assert guides <= linked, sorted(guides - linked)


def test_make_installs_the_extra_of_the_machines_accelerator():
    """`make train` and `make test` install into .venv with CUDA where nvidia-smi is found, with libtpu where TPU
    chips are (/dev/accel*, /dev/vfio/<n>; TPU_CHIPS stands in for them here), and for the CPU otherwise; `-B`
    prints the install as if .venv were out of date, as it is on a fresh clone."""
    import shutil
    import subprocess

    def extras(*args):
        out = subprocess.run(["make", "-n", "-B", "install", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return re.search(r"-e '\.\[([^\]]*)\]'", out.stdout).group(1)

    if shutil.which("nvidia-smi"):
        assert extras() == extras("TPU_CHIPS=/dev/accel0") == "dev,cuda12"
    else:
        assert (extras("TPU_CHIPS="), extras("TPU_CHIPS=/dev/accel0"), extras("TPU_CHIPS=/dev/vfio/0")) == (
            "dev", "dev,tpu", "dev,tpu")
