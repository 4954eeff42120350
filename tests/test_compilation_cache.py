"""kvjax.compilation_cache: where JAX's persistent cache goes, and that it is written."""

import jax
import jax.numpy as jnp
import pytest

from kvjax import compilation_cache


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "root"))
    assert compilation_cache.default_dir() == tmp_path / "root" / "jax"
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "elsewhere"))
    assert compilation_cache.default_dir() == tmp_path / "elsewhere"
    for off in ("0", "off", "False"):
        monkeypatch.setenv(compilation_cache.ENV, off)
        assert compilation_cache.default_dir() is None


def test_the_test_session_never_uses_the_users_cache():
    """tests/conftest.py points entry points run as subprocesses at a temporary folder."""
    d = compilation_cache.default_dir()
    assert d is not None and "kvjax-jax-cache-tests-" in str(d)
    assert compilation_cache.current() == d  # the tests' own programs go there too


@pytest.fixture
def session_cache_back():
    """Puts back the session's own setting (tests/conftest.py turns it on) afterwards."""
    before = compilation_cache.current()
    yield
    compilation_cache.enable(before, on=before is not None)


def test_enable_writes_compiled_programs_and_off_stops(monkeypatch, tmp_path,
                                                      session_cache_back):
    monkeypatch.setattr(compilation_cache, "MIN_COMPILE_SECONDS", 0.0)
    try:
        assert compilation_cache.enable(tmp_path / "c") == tmp_path / "c"
        assert jax.config.jax_enable_compilation_cache
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25)(jnp.arange(7.0)).block_until_ready()
        written = list((tmp_path / "c").iterdir())
        assert written, "nothing written to the persistent cache"
        assert compilation_cache.current() == tmp_path / "c"
    finally:
        assert compilation_cache.enable(on=False) is None
    assert not jax.config.jax_enable_compilation_cache
    jax.jit(lambda x: jnp.cos(x) * 5.0 - 2.5)(jnp.arange(9.0)).block_until_ready()
    assert sorted((tmp_path / "c").iterdir()) == sorted(written)
