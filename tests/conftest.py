"""Shared fixtures: strict JAX, tiny random models, and the real SmolLM2 checkpoint."""

import atexit
import os
import pathlib
import shutil
import tempfile

import jax
import jax.numpy as jnp
import pytest

from kvjax import compilation_cache, native, planner
from kvjax.config import ModelConfig

jax.config.update("jax_numpy_rank_promotion", "raise")


# The planner's picks made during the tests (measured while the workers load the cores)
# go to a folder of this session's, never to the user's cache (kvjax/planner.py); the
# entry points run in subprocesses inherit it.
if planner.PLANNER_CACHE_ENV not in os.environ:
    os.environ[planner.PLANNER_CACHE_ENV] = tempfile.mkdtemp(prefix="kvjax-planner-tests-")
    atexit.register(shutil.rmtree, os.environ[planner.PLANNER_CACHE_ENV], ignore_errors=True)
# ... measured warm (no cache flush before each timed call): the flush was most of a
# pick's time, and these picks only choose which formulation the tests run, each checked
# against the reference whichever it is (docs/decisions/0040-test-picks-warm.md). The
# planner's own tests call its measuring functions with their arguments, or set this.
os.environ.setdefault(planner.PLANNER_MEASURE_ENV, "warm")


# Entry points run by the tests (subprocesses) keep their compiled programs in a folder of
# this session's (kvjax/compilation_cache.py), never in the user's $KVJAX_CACHE/jax.
if compilation_cache.ENV not in os.environ:
    os.environ[compilation_cache.ENV] = tempfile.mkdtemp(prefix="kvjax-jax-cache-tests-")
    atexit.register(shutil.rmtree, os.environ[compilation_cache.ENV], ignore_errors=True)
# ... and so do the tests' own programs: a test file's programs are dropped after it
# (_release_compiled_programs), and the same tiny models' steps compile again in the next
# file and in the other worker; from this folder they load instead of compiling.
compilation_cache.enable()


def pytest_configure(config):
    """A run that leaves out the slow tests (the README's command: pyproject's
    ``-m 'not slow'``) compiles with LLVM at -O0 (``--xla_backend_optimization_level=0``
    in ``XLA_FLAGS``, before JAX starts a backend; the entry points run in subprocesses
    inherit it): its tiny models' time is XLA compiles, and what the tests assert does
    not depend on LLVM's code-generation level. A run with the slow tests keeps the
    default level: they run the real model's compute (docs/decisions/0048-mesh-worker-llvm-o0.md)."""
    markexpr = (config.option.markexpr or "").replace(" ", "")
    flags = os.environ.get("XLA_FLAGS", "")
    if "notslow" not in markexpr or "xla_backend_optimization_level" in flags:
        return
    from jax._src import xla_bridge  # noqa: PLC0415
    if xla_bridge.backends_are_initialized():
        raise pytest.UsageError("tests/conftest.py: a JAX backend started before "
                                "pytest_configure; XLA_FLAGS cannot change now")
    os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()


FAST_LIST = pathlib.Path(__file__).with_name("fast.txt")


def pytest_collection_modifyitems(config, items):
    """Marks ``fast`` the tests listed in tests/fast.txt: the subset ``-m fast`` runs, each
    test file's fastest tests that are not slow (written by scripts/fast_subset.py from a
    full run's times; tests/test_fast_subset.py checks that the list names real tests)."""
    del config
    fast = set(FAST_LIST.read_text().splitlines()) if FAST_LIST.exists() else set()
    for item in items:
        if item.nodeid in fast:
            item.add_marker(pytest.mark.fast)


def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto`` (pyproject's addopts; pytest-xdist): one per usable core, at
    most 4, or ``$PYTEST_XDIST_AUTO_NUM_WORKERS``. The suite is mostly single-threaded
    XLA compiles, so two workers on the 2-core CI machine run it in a little over half
    the time; each worker holds its own SmolLM2 weights (~0.6 GB) and compiled programs,
    hence the cap. ``-n 0`` runs in one process."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if env:
        return int(env)
    return min(native.usable_cores(), 4)


@pytest.fixture
def planner_home(tmp_path, monkeypatch):
    """``tmp_path`` as ``$KVJAX_CACHE``, with the planner's files in its default place
    under it (``planner/``, the session's ``$KVJAX_PLANNER_CACHE`` unset)."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path))
    monkeypatch.delenv(planner.PLANNER_CACHE_ENV, raising=False)
    return tmp_path


@pytest.fixture(autouse=True)
def _planner_ignores_the_load(monkeypatch):
    """The suite's own workers load the cores: picks are not re-measured for it (the
    tests of that rule set the load themselves, tests/test_planner_noise.py)."""
    monkeypatch.setattr(planner, "_others_load_now", lambda: None)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module: the suite compiles thousands
    of programs in one process, and none is shared across files."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2():
    """(LoadedModel for configs/gqa.py in float32, RunConfig). Fetches weights once."""
    from configs import gqa
    from kvjax.inference import runner
    from kvjax.config import run_config_from_dict

    run = run_config_from_dict(gqa.get_config())
    return runner.load(run, progress=False), run


# ------------------------------------------------------------------ shared tiny models
# Random-weight models small enough to compile in seconds on a CPU. A test file narrows
# one of these with overrides (its own factory only fixes the fields it varies); the
# values a test uses decide its shapes, so change none of them without its assertions.

TINY = dict(vocab_size=97, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
            head_dim=8, mlp_dim=48)
"""L=2, D=32, N=4 query heads over K=2 KV heads (GQA, G=2), H=8, F=48, V=97."""

TINY_MLA = dict(TINY, d_model=64, num_kv_heads=4, head_dim=24, mlp_dim=96, attention="mla",
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
"""TINY with MLA attention: C=16 latent, R=8 rotary key, nope=16, V=16 per head, D=64."""


def tiny_config(**overrides):
    """ModelConfig of :data:`TINY` with ``overrides`` replacing fields."""
    return ModelConfig(**{**TINY, **overrides})


def tiny_mla_config(**overrides):
    """ModelConfig of :data:`TINY_MLA` with ``overrides`` replacing fields."""
    return ModelConfig(**{**TINY_MLA, **overrides})


def tiny_ring_config(window, sinks=0, **overrides):
    """TINY with an untied head (a tied random head makes greedy decoding repeat its input
    token) and a ring cache of ``window`` slots, ``sinks`` of them attention sinks."""
    return tiny_config(tie_embeddings=False, window_size=window, num_sink_tokens=sinks,
                       **overrides)


def positions(start, t, batch=1):
    """[batch, t] int32 positions start..start+t-1, the same in every row."""
    return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (batch, t))


def import_entry_point(name: str):
    """Imports ``experiments.<name>`` for its functions and unregisters the absl flags it
    defined, so several entry points that define flags of the same names (``json_out``,
    ``repeats``, ...) can be imported in one test process. Tests call the functions and
    never read those flags; the entry points themselves run in subprocesses."""
    import importlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from absl import flags  # noqa: PLC0415

    module = f"experiments.{name}"
    if module in sys.modules:
        return sys.modules[module]
    before = set(flags.FLAGS)
    mod = importlib.import_module(module)
    for flag in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, flag)
    return mod
