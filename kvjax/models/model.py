"""Decoder-only LM (llama/SmolLM2 style) with a functional cache.

``forward(params, cfg, tokens, positions, cache) -> (logits, cache)`` is the whole API:
the cache is an explicit pytree passed in and returned, never module state.

The layer stack runs either as one ``nn.scan`` (``cfg.scan_layers``: parameters and cache
stacked on a leading L axis; compile time independent of L) or unrolled over per-layer
arrays. Each layer reads its cache slots first, then the new tokens are written in place
with a data dependency on the attention output, which lets XLA update the donated buffer
without copying it (without the dependency XLA cannot order the read before the in-place
write and copies the whole cache: docs/decisions/0004-read-before-write.md).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import kernels
from kvjax.cache import paged as paged_lib
from kvjax.models.attention import SMALL_CHUNK, Attention, softcap
from kvjax.config import ModelConfig
from kvjax.models import decode_kernels, weight_matmul
from kvjax.models.layers import MLP, Einsum, MoE, RMSNorm
from kvjax.models.mla import MLAttention


def _attention_cls(cfg: ModelConfig):
    return MLAttention if cfg.is_mla else Attention


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)); x + mlp(norm(x)); with
    ``cfg.post_norms`` (Gemma 2 / 3) x + post_attn_norm(attn(norm(x))) and
    x + post_mlp_norm(mlp(norm(x))).

    Returns (x [B, T, D], the chunk's new cache entries {name: [B, ..., T, X]}).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, cached, cached_positions):
        c = self.cfg
        dt = c.jnp_dtype
        # the norms before the q/k/v and gate/up products are deferred into them (the
        # native kernel applies them: docs/decisions/0042-rmsnorm-in-the-rows-kernel.md)
        attn = _attention_cls(c)
        h = RMSNorm(c.norm_eps, dt, name="attn_norm")(x, defer=attn is Attention)
        h, new = attn(c, name="attn")(h, positions, cached, cached_positions)
        if c.post_norms:
            h = RMSNorm(c.norm_eps, dt, name="post_attn_norm")(h)
        x = x + h
        h = RMSNorm(c.norm_eps, dt, name="mlp_norm")(x, defer=not c.num_experts)
        if c.num_experts:  # DeepSeek's MoE layers
            h = MoE(c.d_model, c.moe_mlp_dim, c.num_experts, c.num_experts_per_tok,
                    c.num_shared_experts * c.moe_mlp_dim, c.routed_scaling_factor,
                    c.norm_topk_prob, c.moe_groups, c.moe_topk_groups, dt, name="mlp")(h)
        else:
            h = MLP(c.d_model, c.mlp_dim, c.mlp_type, dt, name="mlp",
                    weight_matmul=c.weight_matmul, plan=c.plan)(h)
        if c.post_norms:
            h = RMSNorm(c.norm_eps, dt, name="post_mlp_norm")(h)
        x = x + h
        # The write must follow this layer's read of the cache: tie it to the output, row
        # by row (a NaN in one row must not reach another row's cache entries).
        # min(|x|, 0) is 0 for any finite or infinite x; XLA does not fold it away.
        dep = jnp.minimum(jnp.abs(x[:, 0, 0]), 0)  # [B]
        new = {n: t + dep.reshape((-1,) + (1,) * (t.ndim - 1)).astype(t.dtype)
               for n, t in new.items()}
        return x, new


def _scan_body(block: Block, carry, positions, fresh: bool = False):
    x, cache, layer = carry
    # fresh: the cache holds nothing yet, so the chunk attends to itself only
    cached = None if cache is None or fresh else cache.layer(layer)
    cached_positions = None if cache is None or fresh else cache.positions
    x, new = block(x, positions, cached, cached_positions)
    if cache is not None:
        cache = cache.replace(tensors={
            n: _write(cache, cache.tensors[n], new[n], positions, block.cfg, n, layer)
            for n in cache.tensors})
        if cache.bounds:  # a read-time page selection's key bounds ({}: none)
            cache = cache.replace(bounds=_write_bounds(cache, cache.bounds, new, positions,
                                                       block.cfg, layer))
    return (x, cache, layer + 1), None


def _write_bounds(cache, bounds: dict, new: dict, positions, cfg: ModelConfig, layer=None):
    """A paged cache's page key bounds (Quest) after the chunk's keys ``new`` are written:
    :func:`kvjax.cache.paged.write_bounds` of the keys as the cache holds them."""
    k = cache_lib.read(cfg, new, "k")
    if cache_lib.slot_axis(cfg, "k") == -1:  # 'BKHS' -> [B, K, T, H]
        k = jnp.swapaxes(k, -1, -2)
    return paged_lib.write_bounds(cache, bounds, k, positions, layer)


def _is_ring(cache, i: int) -> bool:
    """Whether layer ``i`` of a paged cache keeps its rows' rings (a local layer of
    ``layer_windows``: :attr:`kvjax.cache.paged.PagedKVCache.rings`)."""
    return isinstance(cache, paged_lib.PagedKVCache) and cache.is_ring(i)


def _write(cache, buf, new, positions, cfg: ModelConfig, name: str, layer=None,
           ring: bool = False):
    """The chunk's entries of tensor ``name`` written into ``buf`` (one layer's, or the
    stacked tensor at ``layer``): into a dense cache's slots, or a paged cache's pages
    (:func:`kvjax.cache.paged.write`), or with ``ring`` a paged cache's ring layer's
    rows (ragged, the slot policy of ``cfg``'s window)."""
    axis = cache_lib.slot_axis(cfg, name)
    if ring:
        return cache_lib.write(buf, new, positions, cfg, axis=axis, ragged=True)
    if isinstance(cache, paged_lib.PagedKVCache):
        return paged_lib.write(cache, buf, new, positions, axis, layer)
    return cache_lib.write(buf, new, positions, cfg, layer=layer, axis=axis,
                           ragged=cache.ragged)


class DecoderLM(nn.Module):
    """Token embedding -> L blocks -> RMSNorm -> LM head (tied or not).

    Parameters: embed/embedding [V, D]; final_norm/scale [D]; lm_head/kernel [D, V] if
    untied; per block {attn_norm, mlp_norm}/scale [D], attn/{q,k,v,o}_proj/kernel,
    mlp/{gate, up, down}/kernel, under 'layers' with a leading L axis when
    cfg.scan_layers, else under 'layers_0' ... 'layers_{L-1}'.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens, positions, cache=None, num_valid=None, fresh: bool = False,
                 last_only: bool = False):
        c = self.cfg
        dt = c.jnp_dtype
        if num_valid is not None:
            # Right padding: token j of row b is real iff j < num_valid[b]. A padded token
            # takes position -1: it sees no key (its attention output is zeros), no query
            # sees it, and the slot policy never writes it.
            real = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :] < num_valid[:, None]
            positions = jnp.where(real, positions, -1)
        embed = nn.Embed(c.vocab_size, c.d_model, param_dtype=dt, dtype=dt, name="embed",
                         embedding_init=nn.initializers.normal(stddev=1.0))
        x = weight_matmul.take(embed.embedding, tokens, dt)  # (an Int8Weight too)
        if c.embed_scale:  # Gemma: sqrt(D) rounded to the model dtype, as its normalizer
            x = x * jnp.asarray(c.d_model ** 0.5, dt)

        if c.scan_layers:
            stack = nn.scan(functools.partial(_scan_body, fresh=fresh),
                            variable_axes={"params": 0, "intermediates": 0},
                            split_rngs={"params": True}, in_axes=nn.broadcast,
                            length=c.num_layers)
            (x, new_cache, _), _ = stack(Block(c, name="layers"),
                                         (x, cache, jnp.zeros((), jnp.int32)), positions)
        else:
            tensors = {n: list(t) for n, t in cache.tensors.items()} if cache else None
            bounds = {n: list(t) for n, t in cache.bounds.items()} \
                if cache is not None else {}
            for i in range(c.num_layers):
                read = cache is not None and not fresh
                ci = c.layer_config(i)  # its own window and rotary base (layer_windows)
                x, new = Block(ci, name=f"layers_{i}")(
                    x, positions, cache.layer(i) if read else None,
                    cache_lib.layer_positions(c, cache, i) if read else None)
                if cache is not None:
                    for n in tensors:
                        tensors[n][i] = _write(cache, tensors[n][i], new[n], positions, ci,
                                               n, ring=_is_ring(cache, i))
                    if bounds and ci.kv_selects_pages:  # (a dense layer reads none)
                        upd = _write_bounds(cache, {n: b[i] for n, b in bounds.items()},
                                            new, positions, ci)
                        for n in bounds:
                            bounds[n][i] = upd[n]
            new_cache = None if cache is None else cache.replace(
                tensors={n: tuple(t) for n, t in tensors.items()})
            if bounds:
                new_cache = new_cache.replace(bounds={n: tuple(t) for n, t in bounds.items()})

        if last_only:  # the LM head for each row's last real token only (a prefill's)
            x = x[:, -1:] if num_valid is None else jnp.take_along_axis(
                x, jnp.maximum(num_valid - 1, 0)[:, None, None], axis=1)
        x = RMSNorm(c.norm_eps, dt, name="final_norm")(x, defer=True)  # into the head
        if c.tie_embeddings:
            logits = weight_matmul.einsum("BTD,VD->BTV", x, embed.embedding, c.weight_matmul,
                                          c.plan)
        else:
            logits = Einsum((c.d_model, c.vocab_size), "BTD,DV->BTV", dt, name="lm_head",
                            impl=c.weight_matmul, plan=c.plan)(x)
        logits = logits.astype(jnp.float32)
        if c.final_logit_softcap is not None:  # Gemma 2: c·tanh(logits / c)
            logits = softcap(logits, c.final_logit_softcap)

        if cache is None:
            return logits, None
        t = tokens.shape[1] if num_valid is None else num_valid
        # Never a silent clamp: a row whose write runs past a dense cache's end gets NaN
        # logits (the host-side entry points in decode.py raise before running).
        if isinstance(cache, paged_lib.PagedKVCache):  # a token past its row's pages
            over = paged_lib.overflows(cache, positions)
            logits = jnp.where(over[:, None, None], jnp.nan, logits)
            return logits, paged_lib.advance(new_cache, positions, num_new=num_valid)
        over = cache_lib.policy_for(c).overflows(cache.length, t, cache.num_slots)
        logits = jnp.where(over[:, None, None], jnp.nan, logits)
        return logits, cache_lib.advance(new_cache, positions, c, num_new=num_valid)


def _init_std(path: tuple, cfg: ModelConfig) -> float | None:
    """Std of the normal init for a parameter (None: ones, for norm scales)."""
    name = path[-2] if path[-1] in ("kernel", "embedding", "scale") else path[-1]
    if path[-1] == "scale":
        return None
    if path[-1] == "embedding":
        return 1.0
    fan_in = {"o_proj": cfg.num_heads * cfg.head_dim, "down": cfg.mlp_dim,
              "wo": cfg.num_heads * (cfg.v_head_dim or cfg.head_dim),
              "w_uk": cfg.kv_lora_rank, "w_uv": cfg.kv_lora_rank,
              "w_uq": cfg.q_lora_rank, "experts_down": cfg.moe_mlp_dim}.get(name) \
        or cfg.d_model
    return fan_in ** -0.5


def init_params(cfg: ModelConfig, rng: jax.Array | int = 0):
    """Randomly initialised parameters in cfg's layout (cfg.dtype arrays).

    Kernels ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm scales 1. Drawn with numpy from
    the seed (an int, or derived from a JAX key): Flax's own ``init`` traces the whole
    model and took seconds per call here, this takes milliseconds.
    """
    if not isinstance(rng, int):
        rng = int(np.asarray(jax.random.key_data(rng)).ravel()[-1])
    gen = np.random.default_rng(rng)
    shapes = param_shapes(cfg)

    def make(path, leaf):
        keys = tuple(getattr(p, "key", str(p)) for p in path)
        std = _init_std(keys, cfg)
        x = np.ones(leaf.shape) if std is None else gen.standard_normal(leaf.shape) * std
        return jnp.asarray(x.astype(np.float32), leaf.dtype)

    return jax.tree_util.tree_map_with_path(make, shapes)


def param_shapes(cfg: ModelConfig):
    """Parameters as ShapeDtypeStructs, without allocating (for cost analysis).

    Traced with the reference formulations and no plan: they do not change the
    parameters. Remembered per config (tracing SmolLM2's 30 unrolled layers takes
    seconds, and the cost report asks for the same shapes once per program)."""
    plain = cfg.replace(decode_attention="xla", weight_matmul="xla", plan=None,
                        prefill_impl="tiled")
    return _param_shapes(plain)


@functools.lru_cache(maxsize=32)
def _param_shapes(plain: ModelConfig):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(
        lambda: DecoderLM(plain).init(jax.random.key(0), tokens, tokens)["params"])


def unstack_layers(params, num_layers: int):
    """Stacked ('layers' with leading L) params -> per-layer 'layers_i' (scan_layers=False)."""
    if "layers" not in params:
        return params
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    return out


def stack_layers(params, num_layers: int):
    """Per-layer 'layers_i' params -> stacked 'layers' with a leading L axis."""
    if "layers" in params:
        return params
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree.map(lambda *a: jnp.stack(a),
                                 *[params[f"layers_{i}"] for i in range(num_layers)])
    return out


FUSED = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), -2), "gate_up": (("gate", "up"), -1)}
"""{fused projection: (the projections it replaces, in order; the axis their kernels and
biases are concatenated along)}: :func:`fuse_projections`."""


def fuses_projections(cfg: ModelConfig) -> bool:
    """Whether :func:`fuse_projections` fuses for ``cfg``: on one device (no plan, or a
    plan of one device). On a mesh the projections stay apart: 'model' splits q_proj
    and k_proj / v_proj by their own heads (:mod:`kvjax.parallel.specs`), which one
    concatenated [D, N + 2K, H] weight cannot be split by
    (docs/decisions/0034-fused-projections-at-load.md)."""
    return cfg.plan is None or cfg.plan.num_devices == 1


def fuse_projections(cfg: ModelConfig, params):
    """``params`` prepared for decoding on one device: every attention layer's q_proj,
    k_proj and v_proj become one qkv_proj (kernel [D, N + 2K, H]: q's heads, then k's,
    then v's; bias [N + 2K, H] with ``qkv_bias``) and every gated MLP's gate and up one
    gate_up (kernel [D, 2F]), so a decode step runs one weight product for each
    (:class:`kvjax.models.attention.Attention`, :class:`kvjax.models.layers.MLP`).

    The same bytes and the same function; call it once, outside jit, where params meet
    the compiled programs (never per step). Saved and converted checkpoints keep the
    separate projections (docs/decisions/0034-fused-projections-at-load.md). Stacked
    layers (a leading L axis), :class:`kvjax.models.weight_matmul.Int8Weight` kernels
    (codes and per-channel scales concatenated alike), MoE's shared MLP and
    ShapeDtypeStructs (shapes only, for lowering) are fused too; MLA's projections are
    left as they are; a tree already fused is returned unchanged, as is any tree when
    :func:`fuses_projections` is False.

    Args:
      cfg: the model (its plan says whether the programs run on a mesh).
      params: the parameter tree (``init_params``, a converted checkpoint, int8 draft
        weights), in either layer layout.
    Returns:
      The tree with fused projections (new arrays; ``params`` is left as it is).
    """
    if not fuses_projections(cfg):
        return params

    def cat(leaves, axis):
        if isinstance(leaves[0], weight_matmul.Int8Weight):
            return weight_matmul.Int8Weight(cat([w.q for w in leaves], axis),
                                            cat([w.scale for w in leaves], axis))
        if isinstance(leaves[0], jax.ShapeDtypeStruct):
            shape = list(leaves[0].shape)
            shape[axis] = sum(w.shape[axis] for w in leaves)
            return jax.ShapeDtypeStruct(tuple(shape), leaves[0].dtype)
        return jnp.concatenate(leaves, axis=axis)

    def walk(tree):
        if not isinstance(tree, dict):
            return tree
        out = {name: walk(sub) for name, sub in tree.items()}
        for fused, (parts, axis) in FUSED.items():
            if not all(isinstance(out.get(p), dict) and "kernel" in out[p]
                       and out[p].keys() == out[parts[0]].keys() for p in parts):
                continue
            subs = [out.pop(p) for p in parts]
            out[fused] = {leaf: cat([sub[leaf] for sub in subs], axis) for leaf in subs[0]}
        return out

    return walk(dict(params))


def decode_param_shapes(cfg: ModelConfig):
    """:func:`param_shapes` as the decode programs take them (:func:`fuse_projections`)."""
    return fuse_projections(cfg, param_shapes(cfg))


def params_for(cfg: ModelConfig, params):
    """Puts params in the layout ``cfg.scan_layers`` asks for (stacked or per layer)."""
    if cfg.scan_layers:
        return stack_layers(params, cfg.num_layers)
    return unstack_layers(params, cfg.num_layers)


def forward(params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: cache_lib.KVCache | None = None, num_valid: jax.Array | None = None,
            *, fresh: bool = False, last_only: bool = False, observe: bool = False):
    """Runs the LM on a chunk of tokens.

    Args:
      params: the parameter pytree (``init_params`` or a converted checkpoint) in the
        layout of ``cfg.scan_layers`` (see :func:`params_for`).
      cfg: the architecture.
      tokens: [B, T] int32 token ids.
      positions: [B, T] int32 absolute positions. With a cache each row's must continue
        that row's cache: positions[b] == cache.length[b] + arange(T). Rows may differ.
      cache: a cache from ``cache.init_cache``, a paged one
        (:func:`kvjax.cache.paged.init_paged_cache`, whose block tables the host fills
        first) or None for a cache-free causal forward.
      num_valid: [B] int32 real tokens per row of a right-padded chunk (None: all T).
        Tokens j >= num_valid[b] are padding: they see no key (attention output zeros),
        no query sees them, they are never written into the cache (a ring keeps its
        entries) and ``length`` advances by num_valid[b]. 0 leaves a row untouched (a
        finished row of a ragged decode). Requires a ragged cache
        (``init_cache(..., ragged=True)``) unless every row has the same count.
      fresh: (static) the caller guarantees the cache holds no token yet (length 0):
        attention then reads none of its slots (the chunk attends to itself) and only
        writes. Wrong results if the cache is not empty.
      last_only: (static) compute the logits of the last position only ([B, 1, V]):
        a prefill needs no other (the LM head is ~17% of SmolLM2's prompt FLOPs).
      observe: (static) also return every layer's rotated queries (MHA/GQA/MQA; MLA:
        the absorbed latent queries [q_nope·W_UK^T ; q_rope], K = 1, G = N, H = C + R),
        which lever 5's methods score the prompt's slots with (:mod:`kvjax.cache.compress`).
    Returns:
      (logits [B, T, V] float32, or [B, 1, V] with ``last_only``: each row's last real
      token; updated cache or None), and with ``observe`` a third item: a tuple of L
      queries [B, T, K, G, H], layer 0 first. A row of a dense cache that would overflow yields
      NaN logits (never a clamped write); ``decode.prefill`` / ``generate`` check lengths
      on the host and raise before running.
    Raises:
      ValueError: the cache records key/value layouts other than ``cfg``'s, a paged
        cache built for other ``layer_windows`` or compression, or (checked
        on the host when positions and the cache's lengths are concrete arrays, i.e.
        outside jit) a row's positions do not continue its cache; the message names the
        row.
    """
    if cache is not None:
        if isinstance(cache, paged_lib.PagedKVCache) and (
                bool(cache.rings) != (cfg.layer_windows is not None) or cache.rings and any(
                    (w is None) != (s == 0) for w, s in zip(cfg.layer_windows, cache.rings))):
            raise ValueError(
                f"a paged cache of per-layer rings {cache.rings or None} with "
                f"model.layer_windows={cfg.layer_windows}; allowed: a cache from "
                "init_paged_cache with the same config (a ring for each local layer)")
        if isinstance(cache, paged_lib.PagedKVCache) and \
                bool(cache.row_ring) != cfg.kv_evicts:
            raise ValueError(
                f"a paged cache of compressed rows {cache.row_ring or None} with "
                f"model.kv_compression={cfg.kv_compression!r}; allowed: a cache from "
                "init_paged_cache with the same config (a ring of kv_budget + "
                "recent_slots slots per row for an evicting method)")
        cache_lib.check_layouts(cache, cfg)
        check_positions(positions, cache)
        if num_valid is not None and not cache.ragged:
            raise ValueError(
                "num_valid (right-padded rows) with a lockstep cache; allowed: a cache from "
                "init_cache(..., ragged=True), whose rows keep their own lengths")
    model = DecoderLM(cfg)
    if not observe:
        return model.apply({"params": params}, tokens, positions, cache, num_valid, fresh,
                           last_only)
    (logits, new_cache), state = model.apply(
        {"params": params}, tokens, positions, cache, num_valid, fresh, last_only,
        mutable=["intermediates"])
    seen = state["intermediates"]
    if cfg.scan_layers:
        stacked = seen["layers"]["attn"]["queries"][0]
        queries = tuple(stacked[i] for i in range(cfg.num_layers))
    else:
        queries = tuple(seen[f"layers_{i}"]["attn"]["queries"][0]
                        for i in range(cfg.num_layers))
    return logits, new_cache, queries


def step_ignores_masked_values(cfg: ModelConfig, cache) -> bool:
    """Whether ``cfg``'s decode step (T = 1, and a small chunk: the same formulation,
    :data:`kvjax.models.attention.SMALL_CHUNK`) over ``cache`` makes a masked slot
    contribute nothing whatever it holds, by itself: the native and Pallas kernels skip
    masked slots, quantized caches select the weights x scales (and zero fp8 codes) in
    the pass that dequantizes them, a paged cache's gathered view is zeroed there
    (:meth:`kvjax.cache.paged.PagedKVCache.layer`), the 'seq'-sharded step zeroes its
    shards. The float XLA step ('xla', 'xla_cache_left', MLA, sinks scored at cache
    positions) does not: a select there costs a copy of the value cache every step
    (docs/decisions/0024-clear-masked-slots-once.md). Reads shapes and the plan only
    (traceable)."""
    if isinstance(cache, paged_lib.PagedKVCache) or cfg.kv_quantized:
        return True
    if cfg.is_mla or cfg.execution.seq_shards > 1:
        return not cfg.is_mla
    if cfg.num_sink_tokens and cfg.rope_positions == "cache":
        return False
    layer = cache.layer(0)
    return kernels.get("decode_attention", decode_kernels.choose(cfg, layer["k"], layer["v"]),
                       internal=True).skips_masked


def clear_masked_slots(cfg: ModelConfig, cache, chunk: int = 1):
    """``cache`` ready for decode steps whatever its never-written slots hold (issue 32:
    a NaN there reached every logit through 0 x NaN): :func:`kvjax.cache.clear_unseen`
    (one pass over the cache) unless the step ignores masked values by itself
    (:func:`step_ignores_masked_values`). The programs that run decode steps over a
    cache their caller hands in apply it once on entry (``decode.generate_program``,
    ``ragged.generate_ragged_program``, ``decode.prefill_program`` of a small chunk,
    the speculative loop), not once per step. ``chunk``: the tokens per forward (T);
    longer than SMALL_CHUNK, the prompt paths zero masked values themselves and the
    cache is returned as is. Traceable; None passes through."""
    if (cache is None or chunk > SMALL_CHUNK
            or step_ignores_masked_values(cfg, cache)):
        return cache
    return cache_lib.clear_unseen(cfg, cache)


def check_positions(positions: jax.Array, cache: cache_lib.KVCache) -> None:
    """Raises ValueError naming the first row whose ``positions`` [B, T] do not continue
    its cache (``cache.length[b] + arange(T)``), or, for a lockstep cache (not
    ``ragged``), that differs from row 0. Skipped for traced values (inside jit the
    callers derive positions from ``cache.length``)."""
    if isinstance(positions, jax.core.Tracer) or isinstance(cache.length, jax.core.Tracer):
        return
    pos = np.asarray(positions)
    length = np.asarray(cache.length)
    if pos.ndim != 2 or length.shape != (pos.shape[0],):
        raise ValueError(
            f"positions of shape {pos.shape} for a cache of lengths {length.shape}; "
            f"allowed: [B, T] with B = {length.shape[0] if length.ndim else '?'}")
    want = length[:, None] + np.arange(pos.shape[1])
    bad = np.nonzero((pos != want).any(axis=1))[0]
    if not cache.ragged and not bad.size:
        bad = np.nonzero((pos != pos[:1]).any(axis=1))[0]
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"positions of row {b} ({pos[b, :4].tolist()}...) differ from row 0's "
                f"({pos[0, :4].tolist()}...) in a lockstep cache; allowed: equal rows, or a "
                "cache from init_cache(..., ragged=True) whose rows have their own lengths")
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"positions of row {b} are {pos[b, :4].tolist()}... but that row's cache holds "
            f"{int(length[b])} tokens; allowed: positions {int(length[b])}, "
            f"{int(length[b]) + 1}, ... (each row continues its own cache)")
