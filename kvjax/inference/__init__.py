"""Inference loops: prefill, the compiled generate loop, sampling, and the main job (runner)."""
