"""Config validation: every invalid field fails before any work, naming field and value."""

import dataclasses

import pytest

from configs import blog, gqa, mha, mqa
from kvjax.config import ConfigError, ModelConfig, run_config_from_dict
from tests.conftest import tiny_config

GOOD = dict(vocab_size=10, num_layers=1, d_model=8, num_heads=4, num_kv_heads=2,
            head_dim=2, mlp_dim=16)


@pytest.mark.parametrize("field,value,pattern", [
    ("num_kv_heads", 3, r"model.num_kv_heads=3; allowed: a divisor of model.num_heads=4"),
    ("num_layers", 0, r"model.num_layers=0; allowed: a positive integer"),
    ("d_model", -8, r"model.d_model=-8; allowed: a positive integer"),
    ("head_dim", 3, r"model.head_dim=3; allowed: an even integer"),
    ("dtype", "float8", r"model.dtype='float8'; allowed: one of"),
    ("attention", "linear", r"model.attention='linear'; allowed: one of"),
    ("mlp_type", "relu", r"model.mlp_type='relu'"),
    ("window_size", 0, r"model.window_size=0"),
    ("window_cache", "paged", r"model.window_cache='paged'; allowed: one of \['ring', 'dense'\]"),
    ("window_cache", "dense", r"model.window_cache='dense'; allowed: .*only with model.window_size"),
    ("key_layout", "BSKH", r"model.key_layout='BSKH'; allowed: one of \['auto', 'BKSH', 'BKHS'\]"),
    ("value_layout", "bksh", r"model.value_layout='bksh'; allowed: one of"),
])
def test_invalid_model_fields(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig(**{**GOOD, field: value})


def test_mla_rejects_a_head_layout():
    mla = dict(GOOD, attention="mla", num_kv_heads=4, kv_lora_rank=4, qk_rope_head_dim=2,
               qk_nope_head_dim=2, v_head_dim=2)
    ModelConfig(**mla)  # 'auto' is fine
    with pytest.raises(ConfigError, match=r"model.value_layout='BKHS'; allowed: 'auto' for attention='mla'"):
        ModelConfig(**mla, value_layout="BKHS")


def test_mha_and_mqa_names_must_agree_with_kv_heads():
    with pytest.raises(ConfigError, match="num_kv_heads=2; allowed: equal to num_heads=4"):
        ModelConfig(**GOOD, attention="mha")
    with pytest.raises(ConfigError, match="1 for attention='mqa'"):
        ModelConfig(**GOOD, attention="mqa")


@pytest.mark.parametrize("path,value,pattern", [
    ("model.num_kv_heads", 4, "num_kv_heads=4; allowed: a divisor of model.num_heads=9"),
    ("dtype", "int8", "model.dtype='int8'"),
    ("max_new_tokens", 0, "max_new_tokens=0"),
    ("sampling.top_p", 1.5, r"sampling.top_p=1.5"),
    ("weights", "llama", "weights='llama'"),
])
def test_override_errors_name_the_field(path, value, pattern):
    c = gqa.get_config()
    *parents, leaf = path.split(".")
    node = c
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(ConfigError, match=pattern):
        run_config_from_dict(c)


def test_prompt_plus_budget_must_fit_max_seq_len():
    c = gqa.get_config()
    c.max_seq_len = 20
    c.max_new_tokens = 16
    run = run_config_from_dict(c)
    run.check_fits(5)  # 5 + 16 - 1 = 20 written: the last new token never is
    with pytest.raises(ConfigError, match=r"max_seq_len=20; allowed: at least prompt tokens "
                                          r"\(6\) \+ max_new_tokens \(16\) - 1 = 21"):
        run.check_fits(6)


def test_shipped_configs_build():
    for mod, k in ((gqa, 3), (mha, 9), (mqa, 1), (blog, 8)):
        run = run_config_from_dict(mod.get_config())
        assert run.model.num_kv_heads == k
    assert run_config_from_dict(blog.get_config()).weights == "random"


@pytest.mark.parametrize("field", ["max_seq_len", "cost_context"])
def test_positions_past_the_float32_exact_range_are_refused(field):
    c = gqa.get_config()
    setattr(c, field, 2 ** 24)
    assert getattr(run_config_from_dict(c), field) == 2 ** 24
    setattr(c, field, 2 ** 24 + 1)
    with pytest.raises(ConfigError, match=rf"{field}=16777217; allowed: at most 16,777,216"):
        run_config_from_dict(c)


def test_model_fields_come_in_three_kinds():
    """Every ModelConfig field is of exactly one kind (issue 28: the architecture apart
    from how this machine runs it); every field a checkpoint states (GGUF's and Hugging
    Face's keys) is architecture, and no execution choice changes the cache's bytes."""
    from kvjax import cache as cache_lib  # noqa: PLC0415
    from kvjax.checkpoints import hf  # noqa: PLC0415
    from kvjax.config import MODEL_FIELD_KINDS  # noqa: PLC0415
    from kvjax.models import convert  # noqa: PLC0415
    kinds = [n for names in MODEL_FIELD_KINDS.values() for n in names]
    assert sorted(kinds) == sorted(f.name for f in dataclasses.fields(ModelConfig))
    arch = set(MODEL_FIELD_KINDS["architecture"])
    assert set(convert.CHECKPOINT_FIELDS) <= arch and set(hf.CONFIG_KEYS) <= arch
    cfg = tiny_config()
    assert cfg.fields_of("architecture")["num_kv_heads"] == cfg.num_kv_heads
    with pytest.raises(ValueError, match=r"kind='arch'; allowed: one of \['architecture'"):
        cfg.fields_of("arch")
    base = cache_lib.cache_bytes(cache_lib.cache_spec(cfg, 1, 32))
    for change in (dict(key_layout="BKHS", value_layout="BKHS"), dict(scan_layers=False),
                   dict(prefill_impl="dense"), dict(decode_attention="xla_cache_left")):
        assert cache_lib.cache_bytes(cache_lib.cache_spec(cfg.replace(**change), 1, 32)) == base
