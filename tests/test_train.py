"""Optax training: a step lowers the loss, checkpoints restore bit-exactly and resume."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models import model
from kvjax.training import train as train_lib
from tests.conftest import tiny_config

CFG = tiny_config(vocab_size=61, d_model=16, num_kv_heads=1, head_dim=4, mlp_dim=24,
                  attention="mqa", scan_layers=False)
TCFG = train_lib.TrainConfig(steps=4, batch_size=2, seq_len=8, peak_lr=1e-2,
                             warmup_steps=1, checkpoint_every=2)


@pytest.fixture(scope="module")
def params():
    return model.params_for(CFG, model.init_params(CFG.replace(scan_layers=True), 0))


@pytest.fixture(scope="module")
def stream():
    return np.random.default_rng(0).integers(0, 61, 2000).astype(np.int32)


def test_one_step_on_a_fixed_batch_lowers_its_loss(params):
    batch = jnp.asarray(np.random.default_rng(1).integers(0, 61, (2, 9)), jnp.int32)
    tcfg = train_lib.TrainConfig(steps=10, warmup_steps=0, peak_lr=1e-2)
    tx = train_lib.make_optimizer(tcfg)
    state, frozen = train_lib.init_state(params, tcfg, tx)
    loss = jax.jit(train_lib.loss_fn, static_argnums=1)
    before = float(loss(params, CFG, batch))
    state, metrics = train_lib.train_step(state, frozen, batch, cfg=CFG, tx=tx)
    after = float(loss(train_lib.merge(state.params, frozen), CFG, batch))
    assert float(metrics["loss"]) == pytest.approx(before, rel=1e-5)
    assert after < before - 0.01
    assert int(state.step) == 1 and float(metrics["grad_norm"]) > 0


def test_checkpoint_round_trip_is_bit_exact_and_resume_continues(params, stream, tmp_path):
    full = train_lib.train(params, CFG, TCFG, stream, workdir=tmp_path / "a", progress=False)
    # Interrupted after step 2 (a checkpoint is written there), then resumed.
    part = train_lib.train(params, CFG, TCFG, stream, workdir=tmp_path / "b", progress=False,
                           stop_after=2)
    assert part.resumed_from is None and len(part.history) == 2
    tx = train_lib.make_optimizer(TCFG)
    like, _ = train_lib.init_state(params, TCFG, tx)
    mngr = train_lib._manager(tmp_path / "b", TCFG)
    restored = train_lib.restore_checkpoint(mngr, like)
    mngr.close()
    assert int(restored.step) == 2
    saved = train_lib.partition(part.params, "all")[0]
    for k, v in saved.items():
        np.testing.assert_array_equal(np.asarray(restored.params[k]), np.asarray(v))
    resumed = train_lib.train(params, CFG, TCFG, stream, workdir=tmp_path / "b",
                              progress=False)
    assert resumed.resumed_from == 2
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(json.loads((tmp_path / "b" / "history.json").read_text())) == 4


def test_trainable_kv_only_changes_key_value_projections(params, stream):
    tcfg = train_lib.TrainConfig(steps=2, batch_size=2, seq_len=8, warmup_steps=0,
                                 trainable="kv", checkpoint_every=0,
                                 compute_dtype="bfloat16")
    res = train_lib.train(params, CFG, tcfg, stream, progress=False)
    flat_new = train_lib.partition(res.params, "all")[0]
    flat_old = train_lib.partition(params, "all")[0]
    changed = {k[-2] for k in flat_old
               if not np.array_equal(np.asarray(flat_old[k]), np.asarray(flat_new[k]))}
    assert changed == {"k_proj", "v_proj"}
    assert all(np.isfinite(h["loss"]) for h in res.history)


def test_schedule_and_config_validation(tmp_path):
    tcfg = train_lib.TrainConfig(steps=100, warmup_steps=10, peak_lr=1e-3,
                                 end_lr_fraction=0.1)
    assert train_lib.lr_at(tcfg, 0) == 0.0
    assert train_lib.lr_at(tcfg, 10) == pytest.approx(1e-3)
    assert train_lib.lr_at(tcfg, 100) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="train.trainable='mlp'"):
        train_lib.TrainConfig(trainable="mlp")
    with pytest.raises(ValueError, match="warmup_steps"):
        train_lib.TrainConfig(steps=5, warmup_steps=5)
    hist = [{"step": i, "loss": 5.0 - 0.1 * i} for i in range(20)]
    train_lib.plot_history({"a": hist, "b": hist[:5]}, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
