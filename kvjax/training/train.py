"""Training and uptraining with optax: AdamW, warmup + cosine decay, clipping, orbax.

Uptraining (Ainslie et al. 2023, "GQA", sec. 2.1): a checkpoint whose KV heads were
mean-pooled (``convert.convert_kv_heads``) keeps training on text for a small fraction
of its pre-training steps, so the model adapts to the pooled heads. Here it continues
on the corpus's training split (``kvjax.data``), with:

* the cache-free forward (``model.forward(..., cache=None)``), next-token cross entropy;
* ``optax.adamw`` on ``optax.warmup_cosine_decay_schedule``, after
  ``optax.clip_by_global_norm``; weight decay on matrices only (not norms);
* float32 master weights; ``compute_dtype='bfloat16'`` casts them for the forward and
  backward (mixed precision), float32 trains in float32;
* ``trainable`` selects what learns ('all', 'attention', or 'kv' = the k/v projections
  alone): gradients are taken only for those leaves, which also saves their backward;
* orbax checkpoints of (step, params, optimizer state) every ``checkpoint_every`` steps;
  batch i depends only on (seed, i) (``data.batch_at``), so a resumed run continues
  exactly as the uninterrupted one would have (same next loss, bit for bit);
* a tqdm bar with the loss and tokens/s, and a loss-curve PNG (:func:`plot_history`).

The same code runs on GPU (use ``scan_layers=True`` there). On the 2-core CPUs the
unrolled stack trains faster than the scanned one
(docs/decisions/0002-unrolled-layer-stack-on-cpu.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import time
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from kvjax.training import data as data_lib
from kvjax.models import model as model_lib
from kvjax.config import DTYPES, ModelConfig

TRAINABLE = ("all", "attention", "kv")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings.

    Attributes:
      steps: optimizer steps in total (a resumed run stops here too).
      batch_size: B, sequences per step.
      seq_len: T, tokens per sequence (inputs; targets are shifted by one).
      peak_lr: learning rate after warmup.
      warmup_steps: linear warmup from 0 to peak_lr.
      end_lr_fraction: the cosine decays to peak_lr * end_lr_fraction at ``steps``.
      weight_decay: AdamW decoupled weight decay (matrices only).
      b1, b2: Adam moments' decay rates.
      clip_norm: global gradient-norm clipping threshold.
      compute_dtype: 'float32' or 'bfloat16' for the forward/backward (master weights are
        float32 either way).
      trainable: 'all', 'attention' (attention projections) or 'kv' (k_proj/v_proj).
      seed: batch sampling seed.
      checkpoint_every: save every this many steps (0: only at the end; needs a workdir).
      log_every: record the loss in the history every this many steps.
    """

    steps: int = 50
    batch_size: int = 4
    seq_len: int = 128
    peak_lr: float = 3e-4
    warmup_steps: int = 5
    end_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    compute_dtype: str = "float32"
    trainable: str = "all"
    seed: int = 0
    checkpoint_every: int = 25
    log_every: int = 1

    def __post_init__(self):
        for f in ("steps", "batch_size", "seq_len", "log_every"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"invalid config: train.{f}={v!r}; allowed: a positive integer")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"invalid config: train.warmup_steps={self.warmup_steps}; "
                             f"allowed: 0 <= warmup_steps < steps={self.steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"invalid config: train.checkpoint_every="
                             f"{self.checkpoint_every}; allowed: an integer >= 0")
        if not self.peak_lr > 0:
            raise ValueError(f"invalid config: train.peak_lr={self.peak_lr}; allowed: > 0")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"invalid config: train.compute_dtype={self.compute_dtype!r}; "
                             "allowed: 'float32' or 'bfloat16'")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"invalid config: train.trainable={self.trainable!r}; "
                             f"allowed: one of {list(TRAINABLE)}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@flax.struct.dataclass
class TrainState:
    """step [] int32; params: the trainable leaves (float32); opt_state: optax state."""

    step: jax.Array
    params: dict
    opt_state: optax.OptState


def is_trainable(path: tuple, trainable: str) -> bool:
    """Whether the parameter at ``path`` (tuple of keys) learns under ``trainable``."""
    if trainable == "all":
        return True
    if "attn" not in path:
        return False
    if trainable == "attention":
        return True
    return any(p in ("k_proj", "v_proj") for p in path)


def partition(params: dict, trainable: str) -> tuple[dict, dict]:
    """(trainable, frozen) flat dicts {path tuple: array} of a parameter tree."""
    flat = traverse_util.flatten_dict(params)
    train = {k: v for k, v in flat.items() if is_trainable(k, trainable)}
    frozen = {k: v for k, v in flat.items() if not is_trainable(k, trainable)}
    return train, frozen


def merge(train: dict, frozen: dict) -> dict:
    """Inverse of :func:`partition`: the nested parameter tree."""
    return traverse_util.unflatten_dict({**frozen, **train})


@functools.lru_cache(maxsize=16)
def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm -> AdamW on warmup + cosine decay; no decay on vectors (norms).

    Cached per config: the optimizer is a static argument of the jitted :func:`train_step`,
    so one object per config means one compilation (a resumed run reuses it).
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tcfg.peak_lr, warmup_steps=tcfg.warmup_steps,
        decay_steps=tcfg.steps, end_value=tcfg.peak_lr * tcfg.end_lr_fraction)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(tcfg.clip_norm),
        optax.adamw(schedule, b1=tcfg.b1, b2=tcfg.b2, weight_decay=tcfg.weight_decay,
                    mask=decay_mask))


def lr_at(tcfg: TrainConfig, step: int) -> float:
    """The learning rate the schedule gives at ``step``."""
    return float(optax.warmup_cosine_decay_schedule(
        0.0, tcfg.peak_lr, tcfg.warmup_steps, tcfg.steps,
        tcfg.peak_lr * tcfg.end_lr_fraction)(step))


def loss_fn(params, cfg: ModelConfig, batch: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats) of batch [B, T + 1] int32, cache-free forward."""
    b, t1 = batch.shape
    positions = jnp.broadcast_to(jnp.arange(t1 - 1, dtype=jnp.int32), (b, t1 - 1))
    logits, _ = model_lib.forward(params, cfg, batch[:, :-1], positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@functools.partial(jax.jit, static_argnames=("cfg", "tx"), donate_argnames=("state",))
def train_step(state: TrainState, frozen: dict, batch: jax.Array, *, cfg: ModelConfig,
               tx: optax.GradientTransformation):
    """One optimizer step; returns (new state, {'loss', 'grad_norm'}) (loss before the step).

    ``cfg.dtype`` is the compute dtype: float32 master weights are cast to it.
    """
    def loss_of(train):
        p = merge(train, frozen)
        p = jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), p)
        return loss_fn(p, cfg, batch)

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return (TrainState(step=state.step + 1, params=params, opt_state=opt_state),
            {"loss": loss, "grad_norm": optax.tree.norm(grads)})


def init_state(params: dict, tcfg: TrainConfig, tx: optax.GradientTransformation):
    """(TrainState at step 0 over the trainable leaves in float32, frozen leaves)."""
    train, frozen = partition(params, tcfg.trainable)
    # Copies: the state is donated to train_step, the caller's arrays must survive.
    train = {k: jnp.array(v, jnp.float32, copy=True) for k, v in train.items()}
    frozen = {k: jnp.asarray(v, jnp.float32) for k, v in frozen.items()}
    return TrainState(step=jnp.zeros((), jnp.int32), params=train,
                      opt_state=tx.init(train)), frozen


# --------------------------------------------------------------------------- checkpoints


def _str_keys(flat: dict) -> dict:
    return {"/".join(k): v for k, v in flat.items()}


def _tuple_keys(flat: dict) -> dict:
    return {tuple(k.split("/")): v for k, v in flat.items()}


def _manager(workdir: str | os.PathLike, tcfg: TrainConfig):
    import orbax.checkpoint as ocp  # noqa: PLC0415 (slow import, only when checkpointing)
    opts = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)  # ~1.6 GB each (135M)
    return ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints",
                                 options=opts)


def save_checkpoint(mngr, state: TrainState) -> None:
    """Saves (step, params, opt_state) at ``state.step`` and waits for the write."""
    import orbax.checkpoint as ocp  # noqa: PLC0415
    tree = {"step": state.step, "params": _str_keys(state.params),
            "opt_state": state.opt_state}
    mngr.save(int(state.step), args=ocp.args.StandardSave(tree), force=True)
    mngr.wait_until_finished()


def restore_checkpoint(mngr, like: TrainState, step: int | None = None) -> TrainState:
    """The state saved at ``step`` (default: the latest), with ``like``'s structure."""
    import orbax.checkpoint as ocp  # noqa: PLC0415
    step = mngr.latest_step() if step is None else step
    abstract = {"step": like.step, "params": _str_keys(like.params),
                "opt_state": like.opt_state}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract)
    tree = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    return TrainState(step=tree["step"], params=_tuple_keys(tree["params"]),
                      opt_state=tree["opt_state"])


# --------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class TrainResult:
    """params: the trained tree (in the input's layout, float32); history: one dict per
    logged step {'step', 'loss', 'grad_norm', 'lr', 'tokens_per_s'}; resumed_from: the
    checkpoint step the run started from (None: from scratch); seconds: wall time."""

    params: dict
    history: list
    resumed_from: int | None
    seconds: float


def train(params: dict, cfg: ModelConfig, tcfg: TrainConfig, stream: np.ndarray,
          workdir: str | os.PathLike | None = None, progress: bool = True,
          stop_after: int | None = None,
          callback: Callable[[dict], None] | None = None) -> TrainResult:
    """Trains ``params`` (layout of ``cfg.scan_layers``) on random windows of ``stream``.

    Args:
      params: the starting parameters.
      cfg: the architecture; its dtype is replaced by ``tcfg.compute_dtype``.
      tcfg: optimisation settings.
      stream: [N] int32 training tokens (``data.TokenizedCorpus.train``).
      workdir: folder for orbax checkpoints and ``history.json``; if it holds a checkpoint,
        training resumes from the latest one (None: no checkpoints).
      progress: show a tqdm bar with loss and tokens/s.
      stop_after: stop once this step is reached (to simulate an interruption).
      callback: called with each history record.
    Returns:
      TrainResult; its params are float32.
    """
    import tqdm  # noqa: PLC0415

    cfg = cfg.replace(dtype=tcfg.compute_dtype)
    tx = make_optimizer(tcfg)
    state, frozen = init_state(params, tcfg, tx)
    mngr = _manager(workdir, tcfg) if workdir is not None else None
    history, resumed = [], None
    hist_path = None if workdir is None else pathlib.Path(workdir) / "history.json"
    if mngr is not None and mngr.latest_step() is not None:
        state = restore_checkpoint(mngr, state)
        resumed = int(state.step)
        if hist_path.is_file():
            history = [h for h in json.loads(hist_path.read_text()) if h["step"] < resumed]

    start_step = int(state.step)
    end = tcfg.steps if stop_after is None else min(tcfg.steps, stop_after)
    start = time.perf_counter()
    bar = tqdm.tqdm(range(start_step, end), initial=start_step, total=tcfg.steps,
                    desc="train", disable=not progress, unit="step")
    last = time.perf_counter()
    for step in bar:
        batch = jnp.asarray(data_lib.batch_at(stream, step, tcfg.batch_size, tcfg.seq_len,
                                              tcfg.seed))
        state, metrics = train_step(state, frozen, batch, cfg=cfg, tx=tx)
        loss = float(metrics["loss"])
        now = time.perf_counter()
        tps = tcfg.tokens_per_step / (now - last)
        last = now
        rec = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
               "lr": lr_at(tcfg, step), "tokens_per_s": tps}
        if step % tcfg.log_every == 0 or step == end - 1:
            history.append(rec)
            if callback is not None:
                callback(rec)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}")
        done = step + 1
        if mngr is not None and (done == end or (tcfg.checkpoint_every
                                                 and done % tcfg.checkpoint_every == 0)):
            save_checkpoint(mngr, state)
            hist_path.write_text(json.dumps(history))
    bar.close()
    if mngr is not None:
        mngr.close()
    return TrainResult(params=merge(state.params, frozen), history=history,
                       resumed_from=resumed, seconds=time.perf_counter() - start)


def plot_history(history, path: str | os.PathLike, title: str = "training loss") -> None:
    """Writes a loss-vs-step PNG (matplotlib Agg): raw losses and their running mean.

    ``history``: one run's records (``TrainResult.history``) or {label: records}.
    """
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    runs = history if isinstance(history, dict) else {"loss": history}
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, h in runs.items():
        if not h:
            continue
        steps = [r["step"] for r in h]
        losses = np.asarray([r["loss"] for r in h])
        line, = ax.plot(steps, losses, alpha=0.35, lw=1, label=f"{label} (each step)")
        k = max(1, len(losses) // 10)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, lw=2, color=line.get_color(),
                label=f"{label} ({k}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def to_layout(params: dict, cfg: ModelConfig) -> dict:
    """Trained float32 params -> cfg's layout and dtype (for evaluation)."""
    params = model_lib.params_for(cfg, params)
    return jax.tree.map(lambda x: jnp.asarray(x, DTYPES[cfg.dtype]), params)


def train_config_dict():
    """``--train.*`` flags: the TrainConfig fields."""
    from ml_collections import config_dict  # noqa: PLC0415
    return config_dict.ConfigDict(dataclasses.asdict(TrainConfig()))


def train_config_from_dict(d) -> TrainConfig:
    """TrainConfig from a ``--train`` ConfigDict."""
    d = d.to_dict() if hasattr(d, "to_dict") else dict(d)
    return TrainConfig(**d)
