"""Shared fixtures: strict JAX, tiny random models, and the real SmolLM2 checkpoint."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def smollm2():
    """(LoadedModel for configs/gqa.py in float32, RunConfig). Fetches weights once."""
    from configs import gqa
    from kvjax.inference import runner
    from kvjax.config import run_config_from_dict

    run = run_config_from_dict(gqa.get_config())
    return runner.load(run, progress=False), run
