"""absl entry points. Keeps JAX's backend-probing INFO lines (e.g. "Unable to initialize
backend 'tpu'") out of the reports."""

import logging

logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
