"""kvjax: the KV-cache bottleneck of autoregressive decoding, measured in JAX/XLA.

Sub-packages (docs/DESIGN.md draws the layers and the data flow):

* :mod:`kvjax.config`, :mod:`kvjax.backend`, :mod:`kvjax.presets`: typed configs, every
  backend-dependent choice, published architectures and their variants;
* :mod:`kvjax.cache`: the functional KV cache (slot policies, named tensors, writes);
* :mod:`kvjax.models`: layers, attention (MHA/GQA/MQA + window), MLA, the decoder LM,
  weight conversions;
* :mod:`kvjax.inference`: prefill, the generate loop, sampling, the main job;
* :mod:`kvjax.analysis`: the blog's cost model, the XLA cost hook, hardware, reports;
* :mod:`kvjax.training`: corpus, perplexity, uptraining;
* :mod:`kvjax.checkpoints`: fetching and reading the pretrained GGUF, the tokenizer.

Modules that lived at the top level before the sub-packages keep their old import
paths (``kvjax.theory``, ``from kvjax import decode``, ...): :mod:`kvjax._moved`
resolves them to the same module objects.
"""

from kvjax import _moved

_moved.install()
