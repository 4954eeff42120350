"""The batch sweep's pieces (kvjax/analysis/batch.py): theory split by phase, XLA's
compiled loop against it at B = 64, the memory wall measured by allocating for real
against theory.max_batch, and budget errors that name the bytes."""

import pytest

from kvjax.analysis import batch, theory
from kvjax.inference import memory


def test_theory_phases_scale_as_the_blog_says():
    cfg = batch.lever_config("blog", "mha", "float16")
    one, many = batch.theory_point(cfg, 4096, 1), batch.theory_point(cfg, 4096, 64)
    assert many["weights_bytes"] == one["weights_bytes"]  # read once for the batch
    assert many["weights_flops"] == 64 * one["weights_flops"]
    assert many["kv_bytes"] == 64 * one["kv_bytes"] and many["kv_flops"] == 64 * one["kv_flops"]
    assert many["weights_intensity"] == pytest.approx(64 * one["weights_intensity"])
    # Blog: phase 3 stays ~1 FLOP/byte (260(t+1) / 256(t+1) for MHA at fp16).
    assert one["kv_intensity"] == pytest.approx(many["kv_intensity"])
    assert 0.9 < one["kv_intensity"] < 1.1
    assert one["A100-80GB_ridge"] == pytest.approx(156)


def test_blog_wall_625_and_levers():
    cfg = batch.lever_config("blog", "mha", "float16")
    assert theory.max_batch(cfg, 4096, batch.BLOG_FREE_BYTES) == 625  # 60,000 MiB / 96 MiB
    rows = {r["lever"]: r for r in batch.wall_table("blog", 4096)}
    assert rows["mha"]["kv_bytes_per_sequence"] == 96 * 2**20
    assert rows["gqa"]["factor_over_mha"] == 4 and rows["mqa"]["factor_over_mha"] == 8
    assert rows["window"]["factor_over_mha"] == 8  # 4096 / 512
    # A100-80GB: 80e9 B less 25% less the weights, over 96 MiB.
    w = rows["mha"]["weights_bytes"]
    assert rows["mha"]["A100-80GB"] == int((0.75 * 80e9 - w) // (96 * 2**20))
    wg = rows["gqa"]["weights_bytes"]  # fewer K/V projections
    assert rows["gqa"]["A100-80GB"] == int((0.75 * 80e9 - wg) // (24 * 2**20))


def test_xla_per_phase_at_batch_64_within_band():
    """Blog GQA (vocabulary 1,024 to compile fast), t = 1K, B = 64, float32, unrolled:
    KV bytes and FLOPs and weight FLOPs match theory; weight bytes match theory plus the
    embedding table, which XLA charges in full to the token gather of a batch."""
    cfg = batch.lever_config("blog", "gqa", "float32", vocab_size=1024)
    th, x = batch.theory_point(cfg, 1024, 64, chips=[]), batch.xla_point(cfg, 1024, 64)
    assert x["xla_over_theory_kv_bytes"] == pytest.approx(1.0, abs=0.05)
    assert x["xla_over_theory_kv_flops"] == pytest.approx(1.0, abs=0.05)
    assert x["xla_over_theory_weights_flops"] == pytest.approx(1.0, abs=0.02)
    table = cfg.vocab_size * cfg.d_model * 4
    assert x["xla_weights_bytes"] == pytest.approx(th["weights_bytes"] + table, rel=0.02)
    # The weights phase's intensity grows with B; the KV phase's stays at G/2 = 2.
    assert x["xla_weights_intensity"] > 20 and x["xla_kv_intensity"] == pytest.approx(2, rel=0.05)


@pytest.mark.parametrize("lever", ["gqa", "window"])
def test_measured_wall_within_one_sequence_of_theory(lever):
    cfg = batch.lever_config("blog", lever, "float32", vocab_size=1024, num_layers=2)
    budget = 48 * 2**20
    w = batch.measure_wall(cfg, 2048, budget)
    assert w.theory >= 2
    assert abs(w.measured - w.theory) <= 1
    assert w.allocated_bytes <= budget
    assert w.per_sequence_bytes == theory.kv_cache_bytes(cfg, 2048)


def test_budget_errors_name_the_bytes():
    cfg = batch.lever_config("blog", "gqa", "float32", vocab_size=1024, num_layers=2)
    with pytest.raises(memory.MemoryCheckError, match=r"budget of 1,048,576 bytes.*asked for"):
        batch.measure_wall(cfg, 2048, 2**20)
    with pytest.raises(memory.MemoryCheckError, match=r"asks for 4,194,304 bytes .*only "
                                                       r"1,000 bytes are available"):
        batch.measure_wall(cfg, 2048, 4 * 2**20, available=1000)


def test_bad_names():
    with pytest.raises(ValueError, match="lever='gqa4'"):
        batch.lever_config("blog", "gqa4")
    with pytest.raises(ValueError, match="shape='gpt'"):
        batch.lever_config("gpt", "gqa")
    assert batch.batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch.batch_sizes(12) == [1, 2, 4, 8, 12]


def test_paged_wall_holds_about_twice_the_reserved_rows():
    """Requests of 1..t tokens (mean about t / 2): pages hold about 2x the requests of
    per-slot reservation at t, never more than 2t / (mean + P); requests all at t gain
    at most the P - 1 tokens of waste (the same count here, t a multiple of P); a
    window's rows hold their window however long the request."""
    rows = {r["lever"]: r for r in batch.paged_wall_table("blog", 4096, 16)}
    mha = rows["mha"]
    assert mha["mean_length"] == pytest.approx(2048.5, abs=1)
    for chip in ("A100-80GB", "H100-SXM", "H200"):
        reserved, paged = mha[f"{chip}_reserved"], mha[f"{chip}_paged"]
        assert 1.9 * reserved <= paged <= 4096 / mha["mean_paged_tokens"] * (reserved + 1)
        assert mha[f"{chip}_paged_full"] == reserved
    assert rows["window"]["mean_paged_tokens"] <= 512 + 16  # W = 512, pages freed
    with pytest.raises(ValueError, match="t=0"):
        batch.wall_lengths(0)


def test_measured_paged_wall_matches_the_allocator_theory():
    """A real pool under a 96 MiB budget (blog GQA, 2 layers): the requests admitted
    through the paged allocator are within 2% of paging.capacity for the pool's bytes
    (the order of lengths is seeded, capacity uses their mean), and about twice the
    rows of t the same bytes hold; a budget too small is refused naming the bytes."""
    cfg = batch.lever_config("blog", "gqa", "float32", vocab_size=1024, num_layers=2)
    w = batch.measure_paged_wall(cfg, 2048, 96 * 2**20, 16)
    assert w.pool_bytes <= 96 * 2**20 - w.weights_bytes
    assert w.theory >= 30 and abs(w.measured - w.theory) <= max(1, 0.02 * w.theory)
    assert 1.8 * w.reserved <= w.measured
    with pytest.raises(memory.MemoryCheckError, match=r"on pages of 16 .* bytes\)"):
        batch.measure_paged_wall(cfg, 2048, 2**20, 16)
    with pytest.raises(ValueError, match="page_size=0"):
        batch.measure_paged_wall(cfg, 2048, 48 * 2**20, 0)
