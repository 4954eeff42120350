// Tiled (FlashAttention-2 forward) prompt attention, one XLA FFI custom call (CPU, float32).
//
// Dao 2023 (FlashAttention-2, Algorithm 1): for each tile of queries, key/value blocks are
// streamed through with an online softmax (running max m, running sum l, unnormalised
// output acc; Milakov & Gimelshein 2018), so no more than one [rows, kBlock] tile of
// scores exists and it never leaves L1/L2:
//   m' = max(m, rowmax(s));  p = exp(s - m');  l' = e^(m - m') l + rowsum(p);
//   acc' = e^(m - m') acc + p V;   out = acc / l.
// GQA/MQA/MHA: a work item is (batch row b, KV head k, tile of kTileRows / G queries);
// its rows are the G query heads of each of its tokens, so every key and value row read
// serves all G heads. Work items are spread over XLA's intra-op threads (pool.h; dynamic
// schedule: under the causal mask later tiles have more keys).
//
// Keys come from two sources, attended in this order: `old` (slots already in the cache,
// any order, -1 = empty) and the chunk itself. Visibility is the rule of
// kvjax.cache.attention_mask, from absolute positions: key filled (k >= 0), causal
// (k <= q), and with a window W and s sinks ((q - k < W - s) | (k < s)). A query with
// position -1 (right padding) sees nothing and gets zeros. A key block none of whose keys
// any query of the tile can see (from the block's min/max positions) is skipped, which
// skips the blocks above the causal diagonal and those entirely outside the window.
//
// Inputs:  q [B, T, K, G, H]; keys [B, K, S, H] (k_bksh=1) or [B, K, H, S] (k_bksh=0);
//          values [B, K, S, V] (v_bksh=1) or [B, K, V, S]; for the chunk (S = T) and the
//          old slots (S = S_old); q_pos [B, T] and old_pos [B, S_old] int32.
// Output:  o [B, T, K, G, V] f32 (rows that see no key: 0).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"
#include "fast_math.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -1e30f;
constexpr int64_t kBlock = 64;      // key slots per block: one score row = 4 AVX-512 vectors
constexpr int64_t kTileRows = 64;   // query rows (tokens x G) per work item, about
constexpr int64_t kVec = 16;        // floats per vector of the register tiles
#if defined(__AVX512F__)
constexpr int kRowsPerPass = 6;     // 6 rows x 4 vectors = 24 accumulators (of 32 registers)
#else
constexpr int kRowsPerPass = 2;     // 2 rows x 4 x (2 halves) = 16 ymm registers
#endif

typedef float vf __attribute__((vector_size(kVec * 4)));
typedef float vfu __attribute__((vector_size(kVec * 4), aligned(4)));  // unaligned access

static inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }


// One source of keys and values (the old slots or the chunk).
struct Source {
  const float* k;
  const float* v;
  const int32_t* pos;
  int64_t S;
  bool k_bksh, v_bksh;
  std::vector<int32_t> lo, hi;  // per (b, block): min / max filled position (INT_MAX / -1)
  std::vector<int32_t> filled;  // per (b, block): filled slots
};

struct Problem {
  int64_t B, T, K, G, H, V;
  float scale;
  int64_t window, sinks;  // window 0: none
};

static void BlockBounds(const Problem& p, Source& src) {
  const int64_t nb = (src.S + kBlock - 1) / kBlock;
  src.lo.assign(p.B * nb, INT32_MAX);
  src.hi.assign(p.B * nb, -1);
  src.filled.assign(p.B * nb, 0);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t s = 0; s < src.S; ++s) {
      const int32_t x = src.pos[b * src.S + s];
      if (x < 0) continue;
      int32_t& lo = src.lo[b * nb + s / kBlock];
      int32_t& hi = src.hi[b * nb + s / kBlock];
      lo = std::min(lo, x);
      hi = std::max(hi, x);
      ++src.filled[b * nb + s / kBlock];
    }
}

// Per-thread scratch.
struct Scratch {
  std::vector<float> qs, acc, m, l, sc, kt, vb;
  std::vector<int32_t> qpos;
  std::vector<char> live;
  std::vector<char> seen;  // per slot of a masked block: some row of the item sees it
  int32_t qlo, qhi;  // min / max position of the item's valid queries
  bool all_valid;    // no padded query (position -1) in the item
};

// Scores sc[r][j] = sum_h qs[r][h] kt[h][j] for rows [0, R) and kBlock slots; kt rows
// are kt_stride apart. Register tiles of kRowsPerPass rows x kBlock slots.
static void Scores(const float* qs, int64_t R, int64_t H, const float* kt,
                   int64_t kt_stride, float* sc) {
  constexpr int64_t NV = kBlock / kVec;
  int64_t r = 0;
  for (; r + kRowsPerPass <= R; r += kRowsPerPass) {
    vf a[kRowsPerPass][NV];
    for (int i = 0; i < kRowsPerPass; ++i)
      for (int64_t c = 0; c < NV; ++c) a[i][c] = vf{} ;
    for (int64_t h = 0; h < H; ++h) {
      const float* kr = kt + h * kt_stride;
      vf kv[NV];
      for (int64_t c = 0; c < NV; ++c) kv[c] = load(kr + c * kVec);
      for (int i = 0; i < kRowsPerPass; ++i) {
        const float x = qs[(r + i) * H + h];
        for (int64_t c = 0; c < NV; ++c) a[i][c] += x * kv[c];
      }
    }
    for (int i = 0; i < kRowsPerPass; ++i)
      for (int64_t c = 0; c < NV; ++c) store(sc + (r + i) * kBlock + c * kVec, a[i][c]);
  }
  for (; r < R; ++r) {
    vf a[NV];
    for (int64_t c = 0; c < NV; ++c) a[c] = vf{};
    for (int64_t h = 0; h < H; ++h) {
      const float x = qs[r * H + h];
      const float* kr = kt + h * kt_stride;
      for (int64_t c = 0; c < NV; ++c) a[c] += x * load(kr + c * kVec);
    }
    for (int64_t c = 0; c < NV; ++c) store(sc + r * kBlock + c * kVec, a[c]);
  }
}

// acc[r][:] += sum_{j < n} p[r][j] vb[j][:] for rows [0, R); vb rows vb_stride apart.
template <int NV, int RP>
static void ValuesFixed(const float* p, int64_t R, int64_t n, const float* vb,
                        int64_t vb_stride, float* acc, const char* live) {
  constexpr int64_t V = NV * kVec;
  int64_t r = 0;
  for (; r + RP <= R; r += RP) {
    vf a[RP][NV];
    for (int i = 0; i < RP; ++i)
      for (int c = 0; c < NV; ++c) a[i][c] = load(acc + (r + i) * V + c * kVec);
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = vb + j * vb_stride;
      vf vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = load(vr + c * kVec);
      for (int i = 0; i < RP; ++i) {
        const float x = p[(r + i) * kBlock + j];
        for (int c = 0; c < NV; ++c) a[i][c] += x * vv[c];
      }
    }
    for (int i = 0; i < RP; ++i)
      for (int c = 0; c < NV; ++c) store(acc + (r + i) * V + c * kVec, a[i][c]);
  }
  for (; r < R; ++r) {
    if (!live[r]) continue;
    vf a[NV];
    for (int c = 0; c < NV; ++c) a[c] = load(acc + r * V + c * kVec);
    for (int64_t j = 0; j < n; ++j) {
      const float x = p[r * kBlock + j];
      for (int c = 0; c < NV; ++c) a[c] += x * load(vb + j * vb_stride + c * kVec);
    }
    for (int c = 0; c < NV; ++c) store(acc + r * V + c * kVec, a[c]);
  }
}

static void ValuesAny(const float* p, int64_t R, int64_t n, const float* vb,
                      int64_t vb_stride, float* acc, int64_t V, const char* live) {
  for (int64_t r = 0; r < R; ++r) {
    if (!live[r]) continue;
    float* ar = acc + r * V;
    for (int64_t j = 0; j < n; ++j) {
      const float x = p[r * kBlock + j];
      const float* vr = vb + j * vb_stride;
#pragma omp simd
      for (int64_t h = 0; h < V; ++h) ar[h] += x * vr[h];
    }
  }
}

static void Values(const float* p, int64_t R, int64_t n, const float* vb, int64_t vb_stride,
                   float* acc, int64_t V, const char* live) {
  switch (V) {
    case 32: return ValuesFixed<2, kRowsPerPass>(p, R, n, vb, vb_stride, acc, live);
    case 64: return ValuesFixed<4, kRowsPerPass>(p, R, n, vb, vb_stride, acc, live);
    case 128: return ValuesFixed<8, (kRowsPerPass > 2 ? 2 : 1)>(p, R, n, vb, vb_stride, acc,
                                                                live);
    default: return ValuesAny(p, R, n, vb, vb_stride, acc, V, live);
  }
}

// One key block [s0, s0 + n) of `src` for the R rows of a work item (batch row b, KV head
// kh) whose queries (scaled) are in w.qs and positions in w.qpos.
static void Block(const Problem& p, const Source& src, int64_t b, int64_t kh, int64_t s0,
                  int64_t n, int64_t R, Scratch& w) {
  const int64_t H = p.H, V = p.V, S = src.S;
  const float* kbase = src.k + (b * p.K + kh) * S * H;
  const float* vbase = src.v + (b * p.K + kh) * S * V;
  const int32_t* kpos = src.pos + b * S;
  // Keys as kt[h][j] (slot axis contiguous), values as vb[j][:]; read in place when the
  // layout already is that and the block is whole, else packed (zero-padded) once here.
  const float* kt;
  int64_t kt_stride;
  if (!src.k_bksh && n == kBlock) {
    kt = kbase + s0;
    kt_stride = S;
  } else {
    float* buf = w.kt.data();
    std::fill(buf, buf + H * kBlock, 0.0f);
    if (src.k_bksh) {
      for (int64_t j = 0; j < n; ++j)
        for (int64_t h = 0; h < H; ++h) buf[h * kBlock + j] = kbase[(s0 + j) * H + h];
    } else {
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(buf + h * kBlock, kbase + h * S + s0, n * sizeof(float));
    }
    kt = buf;
    kt_stride = kBlock;
  }
  const float* vb;
  int64_t vb_stride;
  if (src.v_bksh) {
    vb = vbase + s0 * V;
    vb_stride = V;
  } else {
    float* buf = w.vb.data();
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < V; ++h) buf[j * V + h] = vbase[h * S + s0 + j];
    vb = buf;
    vb_stride = V;
  }
  float* sc = w.sc.data();
  Scores(w.qs.data(), R, H, kt, kt_stride, sc);
  // Is every key of the block visible to every query of the tile? Then no mask.
  const int64_t nb = (S + kBlock - 1) / kBlock;
  const int64_t bi = b * nb + s0 / kBlock;
  const bool full = n == kBlock && src.filled[bi] == kBlock && src.hi[bi] <= w.qlo && w.all_valid &&
                    (p.window <= 0 || (int64_t)w.qhi - src.lo[bi] < p.window - p.sinks);
  // Mask, online softmax; sc becomes the unnormalised probabilities.
  char* seen = w.seen.data();
  if (!full) std::fill(seen, seen + kBlock, 0);
  for (int64_t r = 0; r < R; ++r) {
    float* sr = sc + r * kBlock;
    const int32_t qp = w.qpos[r];
    float bmax = kNegInf;
    if (full) {
      vf mv = load(sr);
      for (int64_t c = 1; c < kBlock / kVec; ++c) {
        const vf x = load(sr + c * kVec);
        mv = mv > x ? mv : x;
      }
      for (int64_t i = 0; i < kVec; ++i) bmax = mv[i] > bmax ? mv[i] : bmax;
    } else {
      const int32_t* kp = kpos + s0;
      const int32_t win = p.window > 0 ? (int32_t)(p.window - p.sinks) : INT32_MAX;
      const int32_t sinks = (int32_t)p.sinks;
#pragma omp simd reduction(max : bmax)
      for (int64_t j = 0; j < kBlock; ++j) {
        const int32_t k = j < n ? kp[j] : -1;
        const bool vis = (k >= 0) & (k <= qp) & ((qp - k < win) | (k < sinks));
        const float x = vis ? sr[j] : kNegInf;
        sr[j] = x;
        seen[j] |= vis;
        bmax = x > bmax ? x : bmax;
      }
    }
    if (!(bmax > 0.5f * kNegInf)) {  // no key of the block visible to this row
      std::fill(sr, sr + kBlock, 0.0f);
      continue;
    }
    const float mold = w.m[r];
    const float mnew = std::max(mold, bmax);
    if (mnew > mold) {
      const float a = fast_exp(mold - mnew);  // ~0 on the row's first visible key
      w.l[r] *= a;
      float* ar = w.acc.data() + r * V;
#pragma omp simd
      for (int64_t h = 0; h < V; ++h) ar[h] *= a;
      w.m[r] = mnew;
    }
    float sum = 0.0f;
    if (full) {
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kBlock; ++j) {
        const float e = fast_exp(sr[j] - mnew);
        sr[j] = e;
        sum += e;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kBlock; ++j) {
        const float e = sr[j] > 0.5f * kNegInf ? fast_exp(sr[j] - mnew) : 0.0f;
        sr[j] = e;
        sum += e;
      }
    }
    w.l[r] += sum;
    w.live[r] = 1;
  }
  // Slots no row of the item sees (never written: position -1, or outside every row's
  // window) contribute nothing whatever they hold (issue 32: a weight of 0 times a NaN
  // value is NaN): their value rows are zeroed in the packed copy (made here if the
  // block was read in place).
  if (!full) {
    int64_t unseen = 0;
    for (int64_t j = 0; j < n; ++j) unseen += !seen[j];
    if (unseen) {
      float* buf = w.vb.data();
      if (vb != buf) std::memcpy(buf, vb, n * V * sizeof(float));  // in place: rows V apart
      for (int64_t j = 0; j < n; ++j)
        if (!seen[j]) std::fill(buf + j * V, buf + (j + 1) * V, 0.0f);
      vb = buf;
      vb_stride = V;
    }
  }
  Values(sc, R, n, vb, vb_stride, w.acc.data(), V, w.live.data());
}

// May a query of positions [qlo, qhi] see a key of positions [klo, khi]?
static inline bool BlockMaySee(const Problem& p, int32_t qlo, int32_t qhi, int32_t klo,
                               int32_t khi) {
  if (khi < 0 || qhi < 0 || klo > qhi) return false;
  if (p.window > 0 && !((int64_t)qlo - khi < p.window - p.sinks || klo < p.sinks))
    return false;
  return true;
}

static void Item(const Problem& p, const float* q, const int32_t* qpos_all, const Source* srcs,
                 int nsrc, int64_t b, int64_t kh, int64_t t0, int64_t t1, float* out,
                 Scratch& w) {
  const int64_t G = p.G, H = p.H, V = p.V;
  const int64_t R = (t1 - t0) * G;
  int32_t qlo = INT32_MAX, qhi = -1;
  bool all_valid = true;
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t x = qpos_all[b * p.T + t];
    for (int64_t g = 0; g < G; ++g) w.qpos[(t - t0) * G + g] = x;
    all_valid &= x >= 0;
    if (x >= 0) {
      qlo = std::min(qlo, x);
      qhi = std::max(qhi, x);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = q + (((b * p.T + t) * p.K + kh) * G + g) * H;
      float* qs = w.qs.data() + ((t - t0) * G + g) * H;
      for (int64_t h = 0; h < H; ++h) qs[h] = qr[h] * p.scale;
    }
  }
  w.qlo = qlo;
  w.all_valid = all_valid;
  w.qhi = qhi;
  std::fill(w.m.begin(), w.m.begin() + R, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + R, 0.0f);
  std::fill(w.acc.begin(), w.acc.begin() + R * V, 0.0f);
  std::fill(w.live.begin(), w.live.begin() + R, 0);
  if (qhi >= 0) {
    for (int i = 0; i < nsrc; ++i) {
      const Source& src = srcs[i];
      const int64_t nb = (src.S + kBlock - 1) / kBlock;
      for (int64_t blk = 0; blk < nb; ++blk) {
        if (!BlockMaySee(p, qlo, qhi, src.lo[b * nb + blk], src.hi[b * nb + blk])) continue;
        const int64_t s0 = blk * kBlock;
        Block(p, src, b, kh, s0, std::min(kBlock, src.S - s0), R, w);
      }
    }
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (t - t0) * G + g;
      float* o = out + (((b * p.T + t) * p.K + kh) * G + g) * V;
      const float* ar = w.acc.data() + r * V;
      const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;
      for (int64_t h = 0; h < V; ++h) o[h] = ar[h] * inv;
    }
}

ffi::Error PrefillAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc,
                                ffi::Buffer<ffi::F32> vc, ffi::Buffer<ffi::S32> qpos,
                                ffi::Buffer<ffi::F32> ko, ffi::Buffer<ffi::F32> vo,
                                ffi::Buffer<ffi::S32> opos, ffi::ResultBuffer<ffi::F32> o,
                                int64_t k_bksh, int64_t v_bksh, float scale, int64_t window,
                                int64_t sinks, int64_t has_old, int64_t threads) {
  auto qd = q.dimensions();
  auto kd = kc.dimensions();
  auto vd = vc.dimensions();
  auto kod = ko.dimensions();
  auto vod = vo.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || kod.size() != 4 ||
      vod.size() != 4 || qpos.dimensions().size() != 2 || opos.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(
        "kvjax_prefill_attention: q rank 5, keys/values rank 4, positions rank 2");
  Problem p{qd[0], qd[1], qd[2], qd[3], qd[4], v_bksh ? vd[3] : vd[2], scale, window, sinks};
  auto slots = [&](auto d, bool bksh) { return bksh ? d[2] : d[3]; };
  auto width = [&](auto d, bool bksh) { return bksh ? d[3] : d[2]; };
  const int64_t S_old = slots(kod, k_bksh);
  if (slots(kd, k_bksh) != p.T || slots(vd, v_bksh) != p.T || width(kd, k_bksh) != p.H ||
      slots(vod, v_bksh) != S_old || width(kod, k_bksh) != p.H ||
      width(vod, v_bksh) != p.V || kd[0] != p.B || kd[1] != p.K || vd[0] != p.B ||
      vd[1] != p.K || kod[0] != p.B || kod[1] != p.K || vod[0] != p.B || vod[1] != p.K ||
      qpos.dimensions()[0] != p.B || qpos.dimensions()[1] != p.T ||
      opos.dimensions()[0] != p.B || opos.dimensions()[1] != S_old)
    return ffi::Error::InvalidArgument("kvjax_prefill_attention: inconsistent shapes");
  Source srcs[2];
  int nsrc = 0;
  if (has_old && S_old > 0)
    srcs[nsrc++] = Source{ko.typed_data(), vo.typed_data(), opos.typed_data(), S_old,
                          k_bksh != 0, v_bksh != 0, {}, {}, {}};
  srcs[nsrc++] = Source{kc.typed_data(), vc.typed_data(), qpos.typed_data(), p.T,
                        k_bksh != 0, v_bksh != 0, {}, {}, {}};
  for (int i = 0; i < nsrc; ++i) BlockBounds(p, srcs[i]);
  const int64_t tile = std::max<int64_t>(1, kTileRows / p.G);  // tokens per work item
  const int64_t tiles = (p.T + tile - 1) / tile;
  const int64_t items = p.B * p.K * tiles;
  const int64_t rows = tile * p.G;
  const int64_t nthreads = std::max<int64_t>(1, threads);
  const float* qp = q.typed_data();
  const int32_t* qposp = qpos.typed_data();
  float* out = o->typed_data();
  const bool parallel = nthreads > 1 && items > 1 && p.T * p.T * p.H * p.B * p.K >= (1 << 16);
  // Parts over XLA's intra-op pool (pool.h; an OpenMP team would spin on the cores XLA's
  // own threads need between calls), each with its scratch, claiming items from a shared
  // counter one at a time (a dynamic schedule: under the causal mask later tiles have
  // more keys).
  std::atomic<int64_t> next{0};
  const int64_t parts = parallel ? std::min(nthreads, items) : 1;
  kvjax_native::ParallelFor(pool, parts, [&](int64_t) {
    Scratch w;
    w.qs.resize(rows * p.H);
    w.acc.resize(rows * p.V);
    w.m.resize(rows);
    w.l.resize(rows);
    w.qpos.resize(rows);
    w.live.resize(rows);
    w.sc.resize(rows * kBlock);
    w.kt.resize(p.H * kBlock);
    w.vb.resize(kBlock * p.V);
    w.seen.resize(kBlock);
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      // Last tiles first: under the causal mask they see the most keys.
      const int64_t tix = tiles - 1 - it % tiles;
      const int64_t bk = it / tiles;
      const int64_t t0 = tix * tile, t1 = std::min(p.T, t0 + tile);
      Item(p, qp, qposp, srcs, nsrc, bk / p.K, bk % p.K, t0, t1, out, w);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPrefillAttention, PrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // chunk keys
                                  .Arg<ffi::Buffer<ffi::F32>>()   // chunk values
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q positions
                                  .Arg<ffi::Buffer<ffi::F32>>()   // old keys
                                  .Arg<ffi::Buffer<ffi::F32>>()   // old values
                                  .Arg<ffi::Buffer<ffi::S32>>()   // old positions
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Attr<int64_t>("k_bksh")
                                  .Attr<int64_t>("v_bksh")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("sinks")
                                  .Attr<int64_t>("has_old")
                                  .Attr<int64_t>("threads"));
