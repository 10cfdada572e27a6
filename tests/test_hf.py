"""Hugging Face checkpoints in and out (`jaxlm.hf`), checked against `transformers` itself.

No checkpoint can be downloaded here: each test model is a small random one made by `transformers`
(PyTorch CPU) and saved with `save_pretrained`, its norms and biases perturbed so that none is the
identity. jaxlm's logits must equal transformers' within 1e-4 (relative to the largest logit,
float32); an export must load in transformers with the same logits, and re-import bit-identically.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import shutil

import floats
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd

from jaxlm import hf, inference, train_state
from jaxlm import mesh as mesh_lib
from jaxlm.data.tokenizer import SentencePieceTokenizer
from jaxlm.errors import UserError
from jaxlm.models import hf as hf_map

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 320
ARCHS = ("llama", "llama3_scaled", "yarn_scaled", "mistral", "qwen2", "qwen3", "qwen3_biased", "gpt2")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 8.0, "beta_slow": 0.5}
VARIANT = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_biased": "qwen3", "gpt2": "gpt2"}  # the rest: llama


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def make_model(arch: str):
    """A small random transformers model of `arch`, norms and biases perturbed away from 1 and 0."""
    torch.manual_seed(0)
    llama_like = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=2, eos_token_id=3))
    elif arch == "llama3_scaled":  # Llama 3.1's RoPE scaling, active at these positions
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **llama_like, rope_theta=500000.0, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}))
    elif arch == "yarn_scaled":  # YaRN (Qwen's long-context scaling), its betas not the defaults, a ramp over
        # 16-wide heads' frequencies: the first kept, two blended, five interpolated; cos and sin scaled
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_like, head_dim=16, rope_parameters=YARN))
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_like))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**llama_like, sliding_window=None))
    elif arch == "qwen3":  # q/k norms; a head wider than hidden_size / heads; tied embeddings; Qwen3's RoPE theta
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **llama_like, head_dim=16, tie_word_embeddings=True, rope_theta=1e6))
    elif arch == "qwen3_biased":  # attention_bias (q, k, v and o), untied, the head hidden_size / heads, its own eps
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **llama_like, head_dim=8, attention_bias=True, tie_word_embeddings=False, rms_norm_eps=1e-5))
    else:  # Qwen2: q/k/v biases, tied embeddings
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like, tie_word_embeddings=True))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save(model, directory: pathlib.Path, dtype=None) -> pathlib.Path:
    """`save_pretrained`, with a tokenizer of fewer tokens than the model has rows (a padded vocabulary)."""
    # A copy in `dtype`: the fixture's model itself must keep its float32 weights for the other tests.
    (copy.deepcopy(model).to(dtype) if dtype is not None else model).save_pretrained(directory)
    SentencePieceTokenizer.train([], VOCAB - 20, "byte").save(directory / "tokenizer.model")
    return directory


class Models(dict):
    """arch -> (transformers model, its saved directory), each made by `make(arch)` when a test first asks
    for it (tests/test_hf_moe.py's MoE models too)."""

    def __init__(self, root: pathlib.Path, make=None):
        super().__init__()
        self.root, self.make = root, make or make_model

    def __missing__(self, arch):
        model = self.make(arch)
        self[arch] = (model, save(model, self.root / arch))
        return self[arch]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return Models(tmp_path_factory.mktemp("hf"))


IDS = np.random.default_rng(0).integers(0, VOCAB, (8, 40))


def reference_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def jaxlm_logits(run: inference.LoadedRun, params=None) -> np.ndarray:
    with spmd.logical_axis_rules(run.rules), jax.set_mesh(run.mesh):
        model = nnx.merge(run.model_spec.graphdef, run.params if params is None else params)
        return np.asarray(jax.jit(lambda m, ids: m(ids))(model, jnp.asarray(IDS)), np.float32)


def close(got: np.ndarray, want: np.ndarray, tol: float = 1e-4) -> float:
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err < tol, err
    return err


@pytest.mark.parametrize("arch", [  # Llama's near relatives in the slow suite (the default suite's time), and Qwen2
    # (its biased q, k and v are qwen3_biased's here; its tensors load in tests/test_registries.py)
    pytest.param(a, marks=pytest.mark.slow) if a in ("llama3_scaled", "yarn_scaled", "mistral", "qwen2") else a
    for a in ARCHS])
def test_imported_model_gives_transformers_logits_and_exports_back(models, arch, tmp_path):
    model, hf_dir = models[arch]
    if arch.startswith("qwen3"):  # through the command line, `python -m jaxlm.hf import` (in this process)
        assert hf.main(["import", f"--hf_dir={hf_dir}", f"--output={tmp_path / 'run'}"]) == 0
        run_dir = tmp_path / "run"
    else:
        run_dir = hf.import_checkpoint(hf_dir, tmp_path / "run")
    run = inference.load_run(run_dir, dtype="float32")
    assert run.step == 0 and run.cfg.model.variant == VARIANT.get(arch, "llama")
    want = reference_logits(model)
    close(jaxlm_logits(run), want)

    # Export (sharded: small files), load in transformers: the same logits as the original.
    out = hf.export_run(run_dir, tmp_path / "exported", dtype="float32", max_shard_bytes=100_000)
    index = json.loads((out / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model) or arch == "mistral"  # Mistral is a Llama: exported as one
    if type(reloaded) is type(model):  # the original's weights, moved there and back, in the same class's forward
        floats.identical(reference_logits(reloaded), want, why=floats.SAME_PROGRAM)
    else:  # Mistral's forward and Llama's: two programs
        floats.close(reference_logits(reloaded), want)
    # Re-imported from the sharded export: bit-identical parameters.
    again = inference.load_run(hf.import_checkpoint(out, tmp_path / "again"), dtype="float32")
    floats.identical(again.params, run.params, why=floats.MOVED)


@pytest.mark.parametrize("factor, head_dim, theta, original", [
    (4.0, 64, 1e4, 128), (8.0, 128, 5e5, 8192), (4.0, 128, 1e6, 32768), (2.0, 16, 1e4, 16), (1.5, 32, 1e4, 64)])
def test_yarn_frequencies_and_attention_factor_are_transformers(factor, head_dim, theta, original):
    """`layers.rope_frequencies(scaling="yarn")` and `rope_attention_factor` against transformers'
    `_compute_yarn_parameters` (Llama 3-, Qwen- and small-head shapes; factors from 1.5 to 8)."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from jaxlm.models.layers import rope_attention_factor, rope_frequencies

    hf_cfg = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=int(original * factor), rope_parameters={
            "rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": original})
    inv_freq, attention_factor = _compute_yarn_parameters(hf_cfg)
    ours = np.asarray(rope_frequencies(head_dim, theta, "yarn", factor, original_max_len=original))
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=3e-7)  # theta^x and 1 / theta^-x: an ulp apart
    plain = np.asarray(rope_frequencies(head_dim, theta))
    assert np.any(ours == plain) and np.any(np.isclose(ours, plain / factor, rtol=1e-6))  # kept, interpolated
    assert rope_attention_factor("yarn", factor) == pytest.approx(attention_factor, rel=1e-12)


def test_a_yarn_config_comes_back_from_the_export():
    """A YaRN config.json (its betas, factor and original length) as model keys, and written back by the export:
    the same rope_parameters; an absent factor is transformers' max_position_embeddings / the original length."""
    original = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160,
                "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                "max_position_embeddings": 128, "rope_parameters": YARN}
    _, keys = hf_map.model_keys(original)
    assert {k: keys[k] for k in ("rope_scaling", "rope_factor", "rope_original_max_len", "rope_beta_fast",
                                 "rope_beta_slow")} == {"rope_scaling": "yarn", "rope_factor": 4.0,
                                                        "rope_original_max_len": 32, "rope_beta_fast": 8.0,
                                                        "rope_beta_slow": 0.5}
    model_cfg = inference.model_config(hf._run_config(keys, "llama", "float32", pathlib.Path("unused")), "cpu",
                                       "float32")
    written = hf_map.hf_config(model_cfg, "llama", bos_id=-1, eos_id=-1, pad_id=None, dtype="float32")
    assert written["rope_parameters"] == YARN and written["rope_scaling"] == YARN
    old_layout = {**original, "rope_parameters": None, "rope_theta": 1e4,
                  "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 32}}
    assert hf_map.model_keys(old_layout)[1]["rope_factor"] == 4.0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_biased"])
def test_qwen3_config_fields_become_model_keys_and_come_back(models, arch):
    """A Qwen3 config.json as jaxlm's model (the qwen3 variant: q/k norms; its head_dim, which need not be
    hidden_size / heads, norm eps, RoPE theta, tied or untied embeddings, attention biases) and written back
    by the export: every field transformers builds the model from equals the original's."""
    _, hf_dir = models[arch]
    original = json.loads((hf_dir / "config.json").read_text())
    model_type, keys = hf_map.model_keys(original)
    model_cfg = inference.model_config(hf._run_config(keys, model_type, "float32", hf_dir / "unused"), "cpu", "float32")
    assert model_cfg.qk_norm and not model_cfg.qkv_bias
    assert (model_cfg.head_dim, model_cfg.use_bias) == ((16, False) if arch == "qwen3" else (8, True))
    assert hf_map.architecture_of(model_cfg) == "qwen3"
    written = hf_map.hf_config(model_cfg, "qwen3", bos_id=-1, eos_id=-1, pad_id=None, dtype="float32")
    fields = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
              "hidden_act", "tie_word_embeddings", "attention_bias", "rope_parameters", "use_sliding_window",
              "sliding_window")
    assert {f: written[f] for f in fields} == {f: original[f] for f in fields}


def test_a_model_with_query_key_norms_exports_only_in_qwen3s_form():
    """q/k norms with q/k/v biases but no output bias (Qwen2's biases), or in a GPT-2-style model, have no
    Hugging Face architecture: one line naming the settings."""
    from helpers import small_config

    for cfg in (small_config(qk_norm=True, qkv_bias=True),
                small_config(qk_norm=True, norm="layernorm", mlp="gelu", position="learned", use_bias=True,
                             tie_embeddings=True)):
        with pytest.raises(UserError, match="qk_norm=True") as refused:
            hf_map.architecture_of(cfg)
        assert "\n" not in str(refused.value)
    assert hf_map.architecture_of(small_config(qk_norm=True, use_bias=True)) == "qwen3"


def test_unscanned_layers_read_and_write_the_same_tensors(models):
    """The same name map serves a model whose blocks are a list (model.scan_layers=False)."""
    model, hf_dir = models["qwen2"]
    arch, keys = hf_map.model_keys(json.loads((hf_dir / "config.json").read_text()))
    cfg = hf._run_config(keys, arch, "float32", hf_dir / "unused")
    cfg.model.scan_layers = False
    model_cfg = inference.model_config(cfg, "cpu", "float32")
    spec = train_state.build_model_spec(model_cfg)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    mesh, abstract = inference.make_inference_mesh(cfg, model_cfg, spec, jax.devices(), rules)
    params = hf._read_params(hf.SafetensorsFiles(hf_dir), abstract, model_cfg, arch)
    assert set(params["blocks"]) == {0, 1}
    with spmd.logical_axis_rules(rules), jax.set_mesh(mesh):
        logits = np.asarray(jax.jit(lambda m, ids: m(ids))(nnx.merge(spec.graphdef, params), jnp.asarray(IDS)))
    close(logits, reference_logits(model))
    # Export's direction on the unscanned tree: every tensor of the file, each layer's under its own name.
    files = hf.SafetensorsFiles(hf_dir)
    assert not any(stacked for *_, stacked in hf_map.param_parts(params, model_cfg, arch))
    written = dict(hf_map.hf_tensors(params, model_cfg, arch, np.float32))
    assert sorted(written) == files.names()
    # read from the file, laid out back
    floats.identical(written, {name: np.asarray(files.slice(name)[:]) for name in written}, why=floats.MOVED)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_import_exactly(models, dtype, tmp_path):
    model, _ = models["llama"]
    hf_dir = save(model, tmp_path / "half", getattr(torch, dtype))
    run = inference.load_run(hf.import_checkpoint(hf_dir, tmp_path / "run"), dtype="float32")
    embedding = model.model.embed_tokens.weight.detach().to(getattr(torch, dtype)).float().numpy()
    # half-precision values cast to float32 (exactly), on the way in as here
    floats.identical(np.asarray(run.params["embed"]["embedding"]), embedding, why=floats.MOVED)
    kept = inference.load_run(hf.import_checkpoint(hf_dir, tmp_path / "kept", param_dtype=dtype))
    assert {x.dtype.name for x in jax.tree.leaves(kept.params)} == {dtype}


def test_a_run_trained_here_exports_to_transformers(facts_run, tmp_path):
    """A jaxlm run trained from scratch (the facts run: Llama variant, grouped-query heads) loads in
    transformers with the logits jaxlm computes."""
    run = inference.load_run(facts_run, dtype="float32")
    out = hf.export_run(facts_run, tmp_path / "facts-hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert (out / run.tokenizer.file_name).is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    # Its SentencePiece tokenizer, loaded by transformers, encodes as jaxlm does (BOS first, as in training).
    from test_hf_tokenizer import TEXTS

    exported_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert exported_tokenizer(TEXTS)["input_ids"] == run.tokenizer.encode(TEXTS, add_bos=True, add_eos=False)
    assert exported_tokenizer.pad_token_id == run.tokenizer.pad_id
    ids = IDS % run.model_cfg.vocab_size
    with torch.no_grad():
        want = reloaded(torch.tensor(ids)).logits.numpy()
    with spmd.logical_axis_rules(run.rules), jax.set_mesh(run.mesh):
        model = nnx.merge(run.model_spec.graphdef, run.params)
        got = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))
    close(got, want)


# ----------------------------------------------------------------------------- bad inputs: one line, exit 2


def error_of(capsys, *argv: str) -> str:
    capsys.readouterr()  # what making the test's files printed
    code = hf.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("jaxlm: error: "), err
    return err


def copy_of(models, arch: str, tmp_path: pathlib.Path, sharded: bool = False) -> pathlib.Path:
    model, _ = models[arch]
    directory = tmp_path / f"{arch}-copy"
    if sharded:
        model.save_pretrained(directory, max_shard_size="100KB")
        SentencePieceTokenizer.train([], VOCAB - 20, "byte").save(directory / "tokenizer.model")
    else:
        shutil.copytree(models[arch][1], directory)
    return directory


def edit_config(directory: pathlib.Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_broken_checkpoints_are_one_line_each(models, tmp_path, capsys):
    def attempt(directory: pathlib.Path) -> str:
        return error_of(capsys, "import", f"--hf_dir={directory}", f"--output={tmp_path / 'out' / directory.name}")

    sharded = copy_of(models, "llama", tmp_path / "a", sharded=True)
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert f"{shard} is missing" in attempt(sharded)

    truncated = copy_of(models, "llama", tmp_path / "b")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 1000])
    assert "is not a complete safetensors file" in attempt(truncated)

    named = copy_of(models, "llama", tmp_path / "c", sharded=True)
    index = json.loads((named / hf.INDEX).read_text())
    index["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = sorted(set(index["weight_map"].values()))[0]
    (named / hf.INDEX).write_text(json.dumps(index))
    assert "does not hold it" in attempt(named)

    wrong_shape = copy_of(models, "llama", tmp_path / "e")
    edit_config(wrong_shape, intermediate_size=192)
    assert "down_proj.weight has shape [64, 160] but config.json implies [64, 192]" in attempt(wrong_shape)

    more_layers = copy_of(models, "gpt2", tmp_path / "f")
    edit_config(more_layers, n_layer=3)
    assert "has no tensor 'transformer.h.2." in attempt(more_layers)

    fewer_layers = copy_of(models, "qwen2", tmp_path / "g")
    edit_config(fewer_layers, num_hidden_layers=1)
    assert "holds tensors this qwen2 config does not use (model.layers.1." in attempt(fewer_layers)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(models["llama"][1] / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    assert "holds only PyTorch pickle files (pytorch_model.bin)" in attempt(pickled)


@pytest.mark.parametrize("arch, changes, words", [
    ("llama", {"model_type": "mamba"}, 'model_type="mamba": jaxlm imports llama, mistral, qwen2, qwen3, gpt2'),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
     'rope_parameters.rope_type="longrope"'),
    ("llama", {"rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}},
     "rope_parameters.mscale_all_dim=0.707: jaxlm's YaRN has the default attention factor"),
    ("llama", {"rope_parameters": {**YARN, "attention_factor": 1.0}}, "rope_parameters.attention_factor=1.0"),
    ("llama", {"rope_parameters": {**YARN, "truncate": False}}, "rope_parameters.truncate=false"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.original_max_position_embeddings=null: YaRN needs the context length"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     'rope_scaling.rope_type="dynamic"'),
    ("mistral", {"sliding_window": 64}, "sliding_window=64: jaxlm has no sliding-window attention (a window shorter "
                                        "than max_position_embeddings)"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=true"),
    ("qwen3", {"use_sliding_window": True}, "config.json: use_sliding_window=true: jaxlm has no sliding-window attention"),
    ("llama", {"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, 'quantization_config="gptq"'),
    ("llama", {"hidden_size": None}, "config.json has no 'hidden_size'"),
])
def test_configs_jaxlm_cannot_represent_are_refused_naming_the_field(models, tmp_path, capsys, arch, changes, words):
    directory = copy_of(models, arch, tmp_path)
    edit_config(directory, **changes)
    err = error_of(capsys, "import", f"--hf_dir={directory}", f"--output={tmp_path / 'out'}")
    assert words in err
    assert not (tmp_path / "out").exists()


def test_unreadable_config_and_occupied_output_are_one_line(models, tmp_path, capsys):
    directory = copy_of(models, "llama", tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert "exists and is not empty" in error_of(capsys, "import", f"--hf_dir={directory}",
                                                 f"--output={tmp_path / 'taken'}")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    (directory / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in error_of(capsys, "import", f"--hf_dir={directory}",
                                                       f"--output={tmp_path / 'o'}")
    with open(directory / "config.json", "wb") as f:  # far past any real config's size
        f.truncate(hf_map.MAX_JSON_BYTES + 1)
    assert "more than the" in error_of(capsys, "import", f"--hf_dir={directory}", f"--output={tmp_path / 'o'}")
    os.remove(directory / "config.json")
    assert "config.json not found" in error_of(capsys, "import", f"--hf_dir={directory}", f"--output={tmp_path / 'o'}")


def test_a_checkpoint_with_a_tokenizer_json_keeps_its_tokenizer_both_ways(tmp_path):
    """A Qwen2-style checkpoint with its byte-level tokenizer.json and chat template: the run
    directory holds that tokenizer, and the export's tokenizer encodes as the original's does."""
    from test_hf_tokenizer import TEXTS, make_qwen2

    hf_dir = tmp_path / "qwen"
    make_qwen2(hf_dir)
    original = transformers.AutoTokenizer.from_pretrained(hf_dir)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=768, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=original.eos_token_id, pad_token_id=original.pad_token_id))
    model.save_pretrained(hf_dir)
    run = inference.load_run(hf.import_checkpoint(hf_dir, tmp_path / "run"))
    assert (run.run_dir / "tokenizer.json").is_file() and run.tokenizer.chat_template == original.chat_template
    ids = original(TEXTS, add_special_tokens=False)["input_ids"]
    assert run.tokenizer.encode(TEXTS, add_bos=False, add_eos=False) == ids
    out = hf.export_run(run.run_dir, tmp_path / "exported")
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported(TEXTS)["input_ids"] == original(TEXTS)["input_ids"]
    assert exported.chat_template == original.chat_template
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (original.eos_token_id, original.pad_token_id)


def train_cli(tmp_path: pathlib.Path, *extra: str):
    """`python -m jaxlm.train` for 3 steps on a small facts corpus in `tmp_path`, on one device."""
    import subprocess
    import sys

    from tiny_run import ONE_DEVICE, ROOT, write_corpus

    if not (tmp_path / "facts.txt").exists():
        write_corpus(tmp_path / "facts.txt", documents=100)
    args = ["--config=configs/tiny.py", f"--config.data.corpus={tmp_path / 'facts.txt'}",
            "--config.data.separator=\\n\\n", "--config.data.seq_len=32", "--config.data.global_batch_size=8",
            "--config.data.tokenize_on_the_fly=true", f"--config.data.cache_dir={tmp_path / 'cache'}",
            "--config.data.val_fraction=0.2", "--config.run.steps=3", "--config.optim.warmup_steps=1",
            "--config.run.compile_cache_dir=", f"--config.run.output_dir={tmp_path}", *extra]
    return subprocess.run([sys.executable, "-m", "jaxlm.train", *args], cwd=ROOT, env=ONE_DEVICE,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_training_starts_from_an_imported_model_and_never_into_it(models, tmp_path):
    """`--config.run.init_from` trains a new run from an imported checkpoint (architecture and
    tokenizer from it); training into the imported directory itself is refused in one line."""
    imported = hf.import_checkpoint(models["gpt2"][1], tmp_path / "imported")
    tuned = train_cli(tmp_path, f"--config.run.init_from={imported}", "--config.run.name=tuned")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert f"initialized from {imported} step 0" in tuned.stdout + tuned.stderr
    summary = json.loads((tmp_path / "tuned" / "summary.json").read_text())
    assert summary["init_from"]["run_dir"] == str(imported) and summary["init_from"]["step"] == 0
    config = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert (config["model"]["variant"], config["model"]["d_model"]) == ("gpt2", 64)

    into = train_cli(tmp_path, "--config.run.name=imported")
    assert into.returncode == 2
    assert into.stderr.strip().splitlines()[-1] == (
        f"jaxlm: error: {imported} holds an imported or compressed model (parameters only), not a run to continue; "
        f"train from it in a new run directory with --config.run.init_from={imported} (and another config.run.name)")
    assert sorted(p.name for p in (imported / "checkpoints").iterdir()) == ["0"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_lora_run_exports_merged_and_as_a_peft_adapter_of_the_original_model(models, arch, tmp_path):
    """LoRA on every projection (one with its own rank) of an imported model, trained a few steps:
    merged into the weights, transformers computes jaxlm's logits; as a PEFT adapter (the adapter
    alone, naming the Hugging Face directory the run's base was imported from), `peft` on that
    original model computes them too, loaded by hand or by the adapter's name alone; `--with_base`
    writes the base beside it, `--base_model` names another; a source that has gone is refused."""
    import subprocess
    import sys

    from tiny_run import ONE_DEVICE, ROOT

    peft = pytest.importorskip("peft")
    original, hf_dir = models[arch]
    imported = hf.import_checkpoint(hf_dir, tmp_path / "imported")
    tuned = train_cli(tmp_path, f"--config.run.init_from={imported}", "--config.run.name=lora", "--config.lora.rank=4",
                      "--config.lora.targets=all", "--config.lora.ranks=w_down:2", "--config.optim.peak_lr=0.01")
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    run = inference.load_run(tmp_path / "lora", dtype="float32")
    want = jaxlm_logits(run)
    base = reference_logits(original)
    assert np.abs(want - base).max() / np.abs(base).max() > 1e-3  # the adapters changed the model

    merged = hf.export_run(run.run_dir, tmp_path / "merged", dtype="float32")
    close(reference_logits(transformers.AutoModelForCausalLM.from_pretrained(merged).eval()), want)

    out = hf.export_run(run.run_dir, tmp_path / "adapter", dtype="float32", adapters="peft")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == (str(hf_dir.resolve()), None)
    assert (config["r"], config["lora_alpha"], config["rank_pattern"]) == (4, 16.0, {"down_proj": 2})
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), out).eval()
    got = reference_logits(adapted)
    close(got, want)
    # as PEFT users load an adapter by its directory alone: the base from base_model_name_or_path
    by_name = peft.AutoPeftModelForCausalLM.from_pretrained(out).eval()
    floats.identical(reference_logits(by_name), got, why=floats.SAME_PROGRAM)

    with_base = hf.export_run(run.run_dir, tmp_path / "with-base", dtype="float32", adapters="peft", with_base=True)
    assert sorted(p.name for p in with_base.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "base"]
    config = json.loads((with_base / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(with_base.resolve() / "base")
    exported_base = transformers.AutoModelForCausalLM.from_pretrained(with_base / "base").eval()
    # the frozen base, unchanged: the original's weights moved out and back, in the same class's forward
    floats.identical(reference_logits(exported_base), base, why=floats.SAME_PROGRAM)
    close(reference_logits(peft.PeftModel.from_pretrained(exported_base, with_base).eval()), want)

    # the command line, naming the base itself: that name wins
    named = tmp_path / "named"
    cli = subprocess.run([sys.executable, "-m", "jaxlm.hf", "export", f"--run_dir={run.run_dir}", f"--output={named}",
                          "--adapters=peft", "--base_model=org/model"], cwd=ROOT, env=ONE_DEVICE, capture_output=True,
                         text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.strip().splitlines()[-1] == (
        f"jaxlm: wrote PEFT adapter {named} (adapter_config.json, adapter_model.safetensors) for the base model "
        f"org/model: peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {named})")
    assert json.loads((named / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/model"

    imported.rename(tmp_path / "moved")  # the record of where the base came from has gone
    with pytest.raises(UserError, match=r"step 0, which is no longer there to say which model it was imported "
                                        r"from; give the base model the adapter belongs to with "
                                        r"--base_model=DIR_OR_HUB_ID, or --with_base"):
        hf.export_run(run.run_dir, tmp_path / "refused", adapters="peft")
    assert not (tmp_path / "refused").exists()


def test_an_adapter_names_a_base_from_the_hub_cache_by_its_repo_id():
    """An import from `snapshot_download`'s cache: the adapter names its base as the hub does (repo id and
    commit), so that `AutoPeftModelForCausalLM` finds it anywhere; any other directory by its path."""
    snapshots = "/home/u/.cache/huggingface/hub/models--{}/snapshots/0123abcd"
    assert hf._hub_id(snapshots.format("meta-llama--Llama-3.2-1B")) == ("meta-llama/Llama-3.2-1B", "0123abcd")
    assert hf._hub_id(snapshots.format("gpt2")) == ("gpt2", "0123abcd")
    assert hf._hub_id(snapshots.format("org--a--b")) is None  # ambiguous: named by its path
    assert hf._hub_id("/models/Llama-3.2-1B") is None
    assert hf._hub_id("/data/models--org--name/checkout") is None


def test_each_device_reads_only_its_block_of_every_tensor(models):
    """Importing onto fsdp=8, the safetensors files are read block by block: every read of a matrix
    asks for one eighth of it (the rows or columns one device holds), and the reads of each matrix add
    up to it exactly once; nothing is read whole and then sliced."""
    _, hf_dir = models["llama"]
    arch, keys = hf_map.model_keys(json.loads((hf_dir / "config.json").read_text()))
    cfg = hf._run_config(keys, arch, "float32", hf_dir / "unused")
    model_cfg = inference.model_config(cfg, "cpu", "float32")
    spec = train_state.build_model_spec(model_cfg)
    mesh, abstract = inference.make_inference_mesh(cfg, model_cfg, spec, jax.devices(), mesh_lib.rules_from_config(
        cfg.mesh.rules))
    assert dict(mesh.shape)["fsdp"] == 8
    files, reads = hf.SafetensorsFiles(hf_dir), []

    class Recorded:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def __getitem__(self, index):
            block = self.inner[index]
            reads.append((self.name, block.size))
            return block

    opened = files.slice
    files.slice = lambda name: Recorded(name, opened(name))
    jax.block_until_ready(hf._read_params(files, abstract, model_cfg, arch))
    matrices = {name for name in files.names() if len(files.shape(name)) == 2}
    assert matrices and {name for name, _ in reads} == set(files.names())
    for name in matrices:
        sizes = [size for n, size in reads if n == name]
        total = math.prod(files.shape(name))
        assert sizes == [total // 8] * 8, (name, sizes, total)


@pytest.mark.slow  # ~40 s: two pairs of processes start JAX and join
def test_two_processes_import_and_export_exactly_what_one_process_does(models, tmp_path):
    """A model larger than one host: the same command on two processes (4 CPU devices each), each
    creating its devices' shards from the files; the run directory it writes holds the parameters a
    single process imports, bit for bit, and exporting it from two processes writes the same tensors."""
    import subprocess
    import sys

    from safetensors.numpy import load_file
    from test_distributed import free_port

    from helpers import xla_flags
    from tiny_run import ROOT

    _, hf_dir = models["qwen2"]

    def on_two_processes(*args: str) -> None:
        port, procs = free_port(), []
        for i in range(2):
            env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
                       XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jaxlm.hf", *args, f"--coordinator=127.0.0.1:{port}", "--num_processes=2",
                 f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]

    on_two_processes("import", f"--hf_dir={hf_dir}", f"--output={tmp_path / 'two'}")
    one = inference.load_run(hf.import_checkpoint(hf_dir, tmp_path / "one"), dtype="float32")
    two = inference.load_run(tmp_path / "two", dtype="float32")
    floats.identical(two.params, one.params, why=floats.MOVED)  # read from the same files

    on_two_processes("export", f"--run_dir={tmp_path / 'two'}", f"--output={tmp_path / 'two-hf'}", "--dtype=float32")
    hf.export_run(tmp_path / "one", tmp_path / "one-hf", dtype="float32")
    single = load_file(tmp_path / "one-hf" / "model.safetensors")
    double = load_file(tmp_path / "two-hf" / "model.safetensors")
    assert sorted(single) == sorted(double)
    floats.identical(double, single, why=floats.MOVED)  # the same tensors, written by one process or two
    assert (tmp_path / "one-hf" / "config.json").read_text() == (tmp_path / "two-hf" / "config.json").read_text()


def test_custom_code_named_by_a_checkpoint_is_never_imported(models, tmp_path):
    """config.json may name custom modeling code (`auto_map`, as `trust_remote_code` checkpoints do):
    jaxlm reads the config as data and never imports it (the module here would leave a file if run)."""
    directory = copy_of(models, "llama", tmp_path)
    edit_config(directory, auto_map={"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"})
    marker = tmp_path / "executed"
    (directory / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nclass Config: pass\nclass Model: pass\n")
    run = inference.load_run(hf.import_checkpoint(directory, tmp_path / "run"), dtype="float32")
    close(jaxlm_logits(run), reference_logits(models["llama"][0]))
    assert not marker.exists()
