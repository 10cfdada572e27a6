"""A `TrainSetup`: the mesh, the sharded train state and the compiled steps, built from a config.

The CLI's loop (`jaxlm.train`), notebooks, benchmarks and the memory planner all build one with
`train_setup.build(cfg)`; `abstract=True` builds it without allocating the state.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jaxlm import config as config_lib
from jaxlm import inference, init_from, loss_scale, objectives, optim, pruning_masks, steps, train_state
from jaxlm import memory as memory_lib
from jaxlm import mesh as mesh_lib
from jaxlm import metrics as metrics_lib
from jaxlm.models import attention, transformer
from jaxlm.models.mlps import moe as moe_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainSetup:
    """Everything a training loop needs, built from a config: the CLI, notebooks and benchmarks share it."""

    cfg: ml_collections.ConfigDict
    derived: config_lib.Derived
    model_cfg: Any  # jaxlm.models.transformer.ModelConfig
    mesh: jax.sharding.Mesh
    rules: Any
    model_spec: Any  # jaxlm.train_state.ModelSpec
    state: Any  # jaxlm.train_state.TrainState, sharded
    shardings: Any
    batch_sharding: jax.sharding.NamedSharding
    schedule: Any
    train_step: Any  # compiled (state, batch[, packed]) -> (state, metrics); donates the state (`attention_choice`)
    eval_step: Any  # compiled (params, batch[, packed]) -> (sum of token losses, tokens)
    # (both take `*frozen_args()` last: an objective's frozen inputs, `Objective.frozen_inputs`)
    tx: Any = None  # the optimizer (optax), for a state built around given parameters (`train_state.from_params`)
    init_from: dict[str, Any] | None = None  # {"run_dir", "step"} the state's parameters were read from (run.init_from)
    objective: Any = dataclasses.field(default_factory=objectives.LanguageModel)  # what the step minimises
    frozen_inputs: Any = None  # the objective's frozen inputs (a teacher's params; abstract until `prepare`)
    _eval_params: Any = None  # `eval_params`'s compiled function, when the optimizer has its own

    def load_run(self, run_dir, **kwargs) -> inference.LoadedRun:
        """Another run's parameters on this setup's mesh by its rules (a distillation teacher, read by its
        objective's `prepare`): `inference.load_run` with this mesh and these rules."""
        return inference.load_run(run_dir, mesh=self.mesh, rules=self.rules, **kwargs)

    def read_start(self, run_dir, step: int) -> tuple[Any, int]:
        """(the parameters a new run of this setup starts with from run `run_dir`'s checkpoint `step`, the step):
        `init_from.read_params`, the read `run.init_from` does (a GRPO run's KL reference reads them again on
        resume, in its objective's `prepare`)."""
        return init_from.read_params(self, pathlib.Path(run_dir), step)

    def abstract_run(self, run_dir, **kwargs):
        """(its ModelSpec, its abstract parameters) as `load_run` will read them: `inference.abstract_run`."""
        return inference.abstract_run(run_dir, self.mesh, self.rules, **kwargs)

    def eval_params(self, state: train_state.TrainState):
        """The parameters to evaluate in a train state: its own, or where the optimizer trains at other points
        than the ones to keep (schedule-free AdamW), the optimizer's (`optim.eval_params`), computed on the
        devices in the parameters' shardings."""
        if not optim.OPTIMIZERS[self.cfg.optim.name].own_eval_params:
            return state.params
        if self._eval_params is None:
            def params_of(state):
                trainable, frozen = self.model_spec.split(state.params)
                return self.model_spec.merge(optim.eval_params(self.cfg.optim, state.opt_state, trainable), frozen)

            self._eval_params = jax.jit(params_of, out_shardings=self.shardings.params)
        with jax.set_mesh(self.mesh):
            return self._eval_params(state)

    def frozen_args(self) -> tuple:
        """The steps' arguments after `packed`: (the objective's frozen inputs,), or () without any."""
        return (self.frozen_inputs,) if self.objective.has_frozen_inputs else ()

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of a batch -> one global array per key, sharded over the batch axes
        (act_batch: data, fsdp, expert). With several processes, `batch` holds the rows `loader.rows_held`
        gives, which processes that share rows (the batch replicated over stages or tensor parallelism
        across them) hold alike."""
        if jax.process_count() == 1:
            return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in batch.items()}
        shape = (self.cfg.data.global_batch_size, self.cfg.data.seq_len)
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v, shape) for k, v in batch.items()}

    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch as abstract arrays, for ahead-of-time compilation."""
        shape = (self.cfg.data.global_batch_size, self.cfg.data.seq_len)
        dtypes = objectives.batch_dtypes(self.objective)
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding) for k, dtype in dtypes.items()}

    def attention_choice(self, batch: dict[str, np.ndarray]) -> bool | None:
        """The `packed` argument of `train_step` for this host batch (before `put_batch`): with cuDNN's
        packed layout (`model_cfg.attention_segments`), whether every row fits it, read from the host's
        segment ids, so that the step holds one attention kernel and no conditional that a GPU would
        stop at to read its predicate (`attention.packed_kernel`). None (the conditional on the device)
        without the packed layout, and with several processes, each of which holds only its own rows."""
        if self.expected_attention_choice() is None:
            return None
        return bool(attention.packed_fits(np.asarray(batch["segment_ids"]), self.model_cfg.attention_segments))

    def expected_attention_choice(self) -> bool | None:
        """The `packed` argument of the step the trainer runs for a batch whose rows fit (the expected
        case): True with the packed layout in one process, else None."""
        return True if self.model_cfg.attention_segments and jax.process_count() == 1 else None

    def compile_train_step(self, packed: bool | None | str = "expected"):
        """Compile the train step ahead of time (works on an abstract state): `.memory_analysis()`,
        `.cost_analysis()` and `.as_text()` of the result tell what the step will cost. `packed`: the
        attention kernel (`train_step`'s argument); by default the one the trainer runs for batches
        whose rows fit (`expected_attention_choice`)."""
        if packed == "expected":
            packed = self.expected_attention_choice()
        state, extra = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                    (self.state, self.frozen_args()))
        with jax.set_mesh(self.mesh):
            return self.train_step.lower(state, self.batch_spec(), packed, *extra).compile()


def resolve_config(
    cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device], quiet: bool = True
) -> ml_collections.ConfigDict:
    """The config with its automatic choices made for these devices: `optim.micro_batches=0` becomes
    the fewest micro-batches that the memory planner fits in a device (logged unless `quiet`)."""
    if cfg.optim.micro_batches:
        return cfg
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    memory = memory_lib.device_memory_bytes(local[0])
    if jax.process_count() > 1:  # every process must compile the same step: process 0's figure decides
        memory = float(multihost_utils.broadcast_one_to_all(np.float64(memory)))
    cfg, line = memory_lib.resolve_micro_batches(cfg, len(devices), memory, local[0].platform)
    if line and not quiet:
        log.info("%s", line)
    return cfg


def build(
    cfg: ml_collections.ConfigDict, devices: Sequence[jax.Device] | None = None, *, abstract: bool = False
) -> TrainSetup:
    """Validate, make the mesh, create the sharded state and the steps (compiled on first call).

    With `abstract=True` the state holds only shapes and shardings (nothing is allocated), for
    `compile_train_step` on recipes larger than this machine. Otherwise it is the state a new run
    starts from: random parameters, or with `run.init_from` another run's (`init_from.load_state`).
    """
    config_lib.validate(cfg)
    devices = list(devices) if devices is not None else jax.devices()
    cfg = resolve_config(cfg, devices, quiet=False)
    derived = config_lib.derive(cfg, len(devices))
    mesh = mesh_lib.make_mesh(derived.mesh_shape, devices, hybrid=cfg.mesh.hybrid)
    rules = mesh_lib.rules_from_config(cfg.mesh.rules)
    model_cfg = transformer.ModelConfig.from_config(cfg.model, devices[0].platform, lora=cfg.lora,
                                                     compress=cfg.compress, **derived.pipeline)
    model_spec = train_state.build_model_spec(model_cfg, cfg.optim.trainable)
    # the model's transforms' and components' parts of the step
    hooks = [*pruning_masks.step_hooks(model_cfg, cfg.compress), *moe_lib.step_hooks(model_cfg)]
    tx, schedule = optim.make_optimizer(cfg.optim, cfg.run.steps, model_spec.decay_mask,
                                        extra=[t for hook in hooks for t in hook.optimizer_transforms()],
                                        matrices=model_spec.matrices)
    scale = cfg.optim.loss_scale_init if loss_scale.enabled(cfg.optim.loss_scale, model_cfg.dtype) else 0.0
    if abstract or cfg.run.init_from:
        state, shardings, _, _ = train_state.abstract_state(model_cfg, tx, mesh, rules, cfg.run.seed, model_spec,
                                                            loss_scale=scale)
    else:
        state, shardings, _ = train_state.create(model_cfg, tx, mesh, rules, cfg.run.seed, model_spec,
                                                 loss_scale=scale)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    objective = objectives.from_config(cfg)
    setup = TrainSetup(
        cfg=cfg, derived=derived, model_cfg=model_cfg, mesh=mesh, rules=rules, model_spec=model_spec, state=state,
        shardings=shardings, batch_sharding=batch_sharding, schedule=schedule, tx=tx, train_step=None,
        eval_step=None, objective=objective,
    )
    # the objective's inputs of the step that it never trains (a teacher's parameters): an argument of each step
    inputs_shardings = None
    if objective.has_frozen_inputs:
        setup.frozen_inputs, inputs_shardings = objective.frozen_inputs(setup)
    step_fn = steps.make_train_step(model_spec, tx, schedule, optim=optim.OptimConfig.from_config(cfg.optim),
                                    metrics=metrics_lib.MetricsConfig.from_config(cfg.metrics), rules=rules,
                                    hooks=hooks, objective=objective)
    setup.train_step = steps.jit_train_step(step_fn, shardings, batch_sharding, inputs_shardings)
    setup.eval_step = steps.jit_eval_step(objective.eval_fn(model_spec, rules), shardings.params, batch_sharding,
                                          inputs_shardings)
    if cfg.run.init_from and not abstract:
        setup.state, setup.init_from = init_from.load_state(setup)
    return setup


def evaluate(setup: TrainSetup, params, batches: list[dict[str, np.ndarray]],
             target_bytes: int | None = None) -> dict[str, float]:
    """Held-out metrics over fixed batches, as the run's objective computes them (`Objective.evaluate`;
    the LM's: `val_loss`, `val_perplexity`, `val_tokens`, `val_bits_per_byte` given `target_bytes`)."""
    return setup.objective.evaluate(setup, params, batches, target_bytes)
