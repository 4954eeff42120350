"""kvjax: the KV-cache bottleneck of autoregressive decoding, measured in JAX/XLA."""
