"""The memory check: a run that cannot fit is refused before allocating, with the bytes
asked for, the bytes available and what would fit."""

import re

import pytest

from configs import blog
from kvjax import cache as cache_lib
from kvjax.config import ConfigError, run_config_from_dict
from kvjax.inference import memory
from tests.conftest import tiny_config

GiB = 2**30


def small(**kw):
    return tiny_config(vocab_size=64, mlp_dim=64, scan_layers=False, **kw)


def test_plan_adds_weights_cache_temporaries_and_margin():
    cfg = small()
    p = memory.plan(cfg, 3, 100, weights_bytes=1000, temp_bytes=500)
    # cache: 2 layers x (k + v) x B=3 x K=2 x S=100 x H=8 x 4 B, + positions 4·B·S + lengths 4·B
    assert p.cache == 2 * 2 * 3 * 2 * 100 * 8 * 4 + 4 * 3 * 100 + 4 * 3
    assert p.cache == cache_lib.total_bytes(cache_lib.cache_spec(cfg, 3, 100))
    assert p.margin == memory.MARGIN_FIXED_BYTES + int(0.1 * (1000 + p.cache + 500))
    assert p.total == 1000 + p.cache + 500 + p.margin


def test_refusal_names_bytes_and_what_fits():
    cfg = small()
    available = memory.plan(cfg, 4, 10_000).total - 1
    with pytest.raises(memory.MemoryCheckError) as e:
        memory.check(cfg, 4, 10_000, what="decode", available=available, source="test")
    msg = str(e.value)
    assert isinstance(e.value, ConfigError)
    need = memory.plan(cfg, 4, 10_000).total
    assert f"needs ~{need:,} bytes" in msg and f"but {available:,} bytes are available (test)" in msg
    assert "--config.ignore_memory_check=True" in msg
    s = int(re.search(r"max_seq_len <= ([\d,]+) at batch_size=4", msg).group(1).replace(",", ""))
    b = int(re.search(r"batch_size <= ([\d,]+) at max_seq_len", msg).group(1).replace(",", ""))
    # the suggestions are the largest that fit
    assert memory.plan(cfg, 4, s).total <= available < memory.plan(cfg, 4, s + 1).total
    assert b == 3 and memory.plan(cfg, 3, 10_000).total <= available
    memory.check(cfg, 4, 10_000, what="decode", available=available + 1)  # fits: no error


def test_window_suggests_only_the_batch():
    cfg = small(window_size=16)
    available = memory.plan(cfg, 2, 10**6).total  # W slots whatever max_seq_len
    with pytest.raises(memory.MemoryCheckError, match=r"what fits: batch_size <= 2 at "):
        memory.check(cfg, 3, 10**6, what="decode", available=available)


def test_nothing_fits():
    with pytest.raises(memory.MemoryCheckError,
                       match=r"no max_seq_len at batch_size=1; no batch_size at"):
        memory.check(small(), 1, 64, what="decode", weights_bytes=10**12, available=10**9)


def test_available_bytes_on_this_host():
    n, source = memory.available_bytes()
    assert n is not None and 0 < n < 2**50 and "MemAvailable" in source


def test_override_skips_the_check():
    c = blog.get_config()
    c.batch_size, c.max_seq_len = 4096, 65536  # 13 TB of float32 cache
    with pytest.raises(memory.MemoryCheckError):
        memory.check_run(run_config_from_dict(c), weights_loaded=False)
    c.ignore_memory_check = True
    memory.check_run(run_config_from_dict(c), weights_loaded=False)
