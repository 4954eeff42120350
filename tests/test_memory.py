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


def fake_host(tmp_path, cgroup: str, files: dict, mem_available_kb: int = 64 * 2**20):
    """A fake root: proc/meminfo (64 GiB available), proc/self/cgroup, and cgroup files."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(
        f"MemTotal:       {2 * mem_available_kb} kB\nMemFree:  1 kB\n"
        f"MemAvailable:   {mem_available_kb} kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_cgroup_v2_limit_caps_the_host_figure(tmp_path, monkeypatch):
    """A 1 GiB container on a host with 64 GiB free: 1 GiB - usage is available (the check
    used to report the host's MemAvailable)."""
    root = fake_host(tmp_path, "0::/\n", {"memory.max": f"{GiB}\n",
                                           "memory.current": f"{100 * 2**20}\n"})
    n, source = memory.available_bytes(root=root)
    assert n == GiB - 100 * 2**20
    assert "cgroup v2 memory.max - memory.current" in source and "MemAvailable" in source
    monkeypatch.setattr(memory, "ROOT", root)
    assert memory.available_bytes() == (n, source)
    with pytest.raises(memory.MemoryCheckError, match=rf"but {n:,} bytes are available "
                       r"\(cgroup v2 memory.max"):
        memory.check(small(), 1, 64, what="decode", weights_bytes=2 * GiB)
    memory.check(small(), 1, 64, what="decode", weights_bytes=GiB // 4)  # fits


def test_cgroup_v2_max_means_no_limit_and_a_parent_limit_binds(tmp_path):
    root = fake_host(tmp_path, "0::/a/b\n", {
        "memory.max": "max\n", "memory.current": "5\n",
        "a/memory.max": f"{3 * GiB}\n", "a/memory.current": f"{GiB}\n",
        "a/b/memory.max": "max\n", "a/b/memory.current": f"{GiB // 2}\n"})
    n, source = memory.available_bytes(root=root)
    assert n == 2 * GiB and source.startswith("cgroup v2") and "/a)" in source
    root = fake_host(tmp_path / "nolimit", "0::/\n", {"memory.max": "max\n",
                                                       "memory.current": "5\n"})
    assert memory.cgroup_available(root) is None
    assert memory.available_bytes(root=root) == (64 * GiB, "host MemAvailable (/proc/meminfo)")


def test_cgroup_v1_limit_and_its_huge_no_limit_value(tmp_path):
    cg = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    root = fake_host(tmp_path, cg, {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.usage_in_bytes": f"{3 * GiB}\n",
        "memory/docker/abc/memory.limit_in_bytes": f"{GiB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{GiB // 4}\n"})
    n, source = memory.available_bytes(root=root)
    assert n == GiB - GiB // 4
    assert "cgroup v1 memory.limit_in_bytes - memory.usage_in_bytes" in source
    assert source.split("(")[1].startswith(str(tmp_path / "sys/fs/cgroup/memory/docker/abc"))
    # a container whose mount shows its own cgroup at the top, the host path absent
    root = fake_host(tmp_path / "c", cg, {"memory/memory.limit_in_bytes": f"{GiB}\n",
                                          "memory/memory.usage_in_bytes": "0\n"})
    assert memory.available_bytes(root=root)[0] == GiB
    root = fake_host(tmp_path / "u", cg, {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.usage_in_bytes": "0\n"})
    assert memory.available_bytes(root=root) == (64 * GiB, "host MemAvailable (/proc/meminfo)")


def test_host_figure_wins_when_smaller_than_the_limit(tmp_path):
    root = fake_host(tmp_path, "0::/\n", {"memory.max": f"{8 * GiB}\n",
                                           "memory.current": "0\n"},
                     mem_available_kb=2**20)
    assert memory.available_bytes(root=root) == (GiB, "host MemAvailable (/proc/meminfo)")
