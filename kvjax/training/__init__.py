"""Data and training: the evaluation corpus, perplexity through the cache, optax uptraining."""
