"""kvjax: the KV-cache bottleneck of autoregressive decoding, measured in JAX/XLA.

Sub-packages (docs/DESIGN.md draws the layers and the data flow):

* :mod:`kvjax.config`, :mod:`kvjax.backend`, :mod:`kvjax.presets`: typed configs, every
  backend-dependent choice, published architectures and their variants;
* :mod:`kvjax.plan`, :mod:`kvjax.planner`: the execution plan of a program and its
  resolution before tracing (measuring what it lacks on this machine);
* :mod:`kvjax.ops`: pure array functions (masks, online-softmax partials, layouts);
* :mod:`kvjax.cache`: the functional KV cache (slot policies, named tensors, writes);
* :mod:`kvjax.models`: layers, attention (MHA/GQA/MQA + window), MLA, the decoder LM,
  weight conversions;
* :mod:`kvjax.inference`: prefill, the generate loop, sampling, the main job;
* :mod:`kvjax.analysis`: the blog's cost model, the XLA cost hook, hardware, reports;
* :mod:`kvjax.training`: corpus, perplexity, uptraining;
* :mod:`kvjax.checkpoints`: fetching and reading the pretrained GGUF, the tokenizer;
* :mod:`kvjax.native`: optional CPU kernels (XLA FFI), built on first use;
* :mod:`kvjax.parallel`: the cache and programs on a device mesh.
"""
