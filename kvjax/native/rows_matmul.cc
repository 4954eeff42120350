// Products of a few rows with a weight matrix, XLA FFI custom calls (CPU): float32
// weights, and int8 weights widened in registers (RowsMatmulInt8Impl, at the end).
//
//   y[M, N] = x[M, K] @ w[K, N]    (w_nk = 0: the weight stored [in, out], Flax's kernels)
//   y[M, N] = x[M, K] @ w[N, K]^T  (w_nk = 1: stored [out, in], the tied LM head)
//
// A decode step multiplies M = B (batch rows) activations by every weight matrix once.
// For few rows the product is a stream of the weight through the cores: the weight is
// read from memory exactly once for all M rows (a register tile of up to MB rows by
// NB columns accumulates while a column panel of w passes; the next row tiles re-read
// the same panel from L2), so the step costs max(weight bytes / bandwidth, 2·M·K·N /
// FLOP peak) (the roofline, Williams et al. 2009) instead of one pass per row.
//
// The columns (w_nk = 0) or output rows (w_nk = 1) are split into contiguous ranges over
// XLA's own intra-op thread pool (pool.h: no second thread pool spinning beside XLA's);
// one row against a [K, N] weight (B = 1 decode) splits the K rows instead, so that each
// thread reads one contiguous stretch of the weight (WalkRowsKN). With the attribute split
// = 1, several rows against a [K, N] weight split K too (each part's partial rows added at
// the end): which split is faster depends on the machine (faster on a 2-core Intel Xeon,
// no better on a 2-core AMD EPYC; docs/decisions/0018-weight-splits-per-machine.md), so
// model.weight_matmul='auto' measures both ('native', 'native_ksplit'; kvjax/planner.py).
// Several rows against an [N, K] weight (the tied LM head) are register tiles of dot
// products summed across the lanes at the end, or with lanes = 1 the rows sit in the
// vector lanes and each weight element is broadcast once (RangeNKT; 'native_lanes';
// docs/decisions/0018-weight-splits-per-machine.md); 'auto' measures both.
//
// Vectors: GCC vector extensions, 16 floats with AVX-512F, else 8 (AVX2 / others);
// built with -march=native by kvjax/native/rows_matmul.py.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include <immintrin.h>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
constexpr int MB = 6;   // rows per register tile (w_nk = 0): 6 x 4 accumulators
constexpr int MBT = 4;  // rows per register tile (w_nk = 1)
constexpr int NRT = 4;  // weight rows per register tile (w_nk = 1)
#else
constexpr int VW = 8;
constexpr int MB = 3;
constexpr int MBT = 2;
constexpr int NRT = 4;
#endif
constexpr int NV = 4;             // vectors per column panel
constexpr int NB = VW * NV;       // columns per panel (w_nk = 0)
#ifndef KROWS
#define KROWS 16
#endif
constexpr int64_t kRowBlock = KROWS;  // weight rows per block (w_nk = 0, column split)
// Weight rows per block of the K split (split = 1, w_nk = 0): 32-64 rows ran fastest
// (docs/decisions/0018-weight-splits-per-machine.md).
constexpr int64_t kSplitRowBlock = 64;
// The one-row walk prefetches this many floats (4 KiB) ahead of its stream into L2
// (docs/decisions/0020-one-row-weight-walk.md).
constexpr int64_t kWalkPrefetch = 1024;
#ifndef KN_PREFETCH
#define KN_PREFETCH 1
#endif
#ifndef PF_CHUNKS
#define PF_CHUNKS 2
#endif
constexpr int64_t kPrefetchChunks = PF_CHUNKS;  // column chunks prefetched ahead
// Weights below this many elements (256 KiB of float32) are read by the calling thread
// alone: too short a call to be worth waking a pool thread.
constexpr int64_t kMinSplit = 64 * 1024;

#if defined(__AVX512F__)
typedef __m512 vf;
static inline vf load(const float* p) { return _mm512_loadu_ps(p); }
static inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf splat(float a) { return _mm512_set1_ps(a); }
static inline vf zero() { return _mm512_setzero_ps(); }
static inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
static inline vf load(const float* p) { return _mm256_loadu_ps(p); }
static inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf splat(float a) { return _mm256_set1_ps(a); }
static inline vf zero() { return _mm256_setzero_ps(); }
static inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#else  // portable: GCC vector extensions
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
static inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
static inline vf splat(float a) { return vf{} + a; }
static inline vf zero() { return vf{}; }
static inline vf fma(vf a, vf b, vf c) { return a * b + c; }
static inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}
#endif

// Keeps a loaded weight vector in a register. Without it GCC 12 folds TileNK's weight
// loads into every FMA that uses them (MR loads per vector instead of one: 20 loads per
// 16 FMAs in the 4 x 4 tile; docs/decisions/0017-keep-loads-in-registers.md).
// decode_attention.cc does the same.
static inline vf reg(vf v) {
#if defined(__GNUC__) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
  asm("" : "+x"(v));
#endif
  return v;
}

// y[r, n0:n0+NVR*VW] (+)= sum over k in [k0, k1) of x[r, k] w[k, n0:...] for r < MR,
// w stored [K, N]: the accumulators stay in registers over the block of k rows.
template <int MR, int NVR>
static void TileKN(const float* x, int64_t K, const float* w, int64_t N, int64_t n0,
                   float* y, int64_t k0, int64_t k1, int64_t ks) {
  vf acc[MR][NVR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NVR; ++j) acc[r][j] = k0 != ks ? load(y + r * N + n0 + j * VW) : zero();
  const float* wp = w + k0 * N + n0;
  for (int64_t k = k0; k < k1; ++k, wp += N) {
    vf b[NVR];
#pragma GCC unroll 8
    for (int j = 0; j < NVR; ++j) b[j] = load(wp + j * VW);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vf a = splat(x[r * K + k]);
#pragma GCC unroll 8
      for (int j = 0; j < NVR; ++j) acc[r][j] = fma(a, b[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NVR; ++j) store(y + r * N + n0 + j * VW, acc[r][j]);
}

// y[r, n] for r < MR, n in [n0, n0 + NR), w stored [N, K]; K % VW handled as a tail.
template <int MR, int NR>
static void TileNK(const float* x, int64_t K, const float* w, int64_t N, int64_t n0,
                   float* y) {
  vf acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[r][j] = zero();
  const int64_t kv = K / VW * VW;
  for (int64_t k = 0; k < kv; k += VW) {
    vf b[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) b[j] = reg(load(w + (n0 + j) * K + k));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vf a = load(x + r * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[r][j] = fma(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t k = kv; k < K; ++k) s += x[r * K + k] * w[(n0 + j) * K + k];
      y[r * N + n0 + j] = s;
    }
}

template <int MAXR, template <int> class F>
struct Dispatch;

template <int R>
struct KN {  // one NB-column chunk
  static void Run(const float* x, int64_t K, const float* w, int64_t N, int64_t n0,
                  float* y, int64_t k0, int64_t k1, int64_t ks) {
    TileKN<R, NV>(x, K, w, N, n0, y, k0, k1, ks);
  }
};
template <int R>
struct NK {
  static void Run(const float* x, int64_t K, const float* w, int64_t N, int64_t n0,
                  float* y, int64_t, int64_t, int64_t) {
    TileNK<R, NRT>(x, K, w, N, n0, y);
  }
};

// Calls F<r>::Run for a tile of r rows, 1 <= r <= MAXR.
template <template <int> class F, int R>
static inline void RunRows(int r, const float* x, int64_t K, const float* w, int64_t N,
                           int64_t n0, float* y, int64_t k0 = 0, int64_t k1 = 0,
                           int64_t ks = 0) {
  if constexpr (R >= 1) {
    if (r == R) return F<R>::Run(x, K, w, N, n0, y, k0, k1, ks);
    RunRows<F, R - 1>(r, x, K, w, N, n0, y, k0, k1, ks);
  }
}

// Columns [c0, c1) of y (w_nk = 0: c0 a multiple of NB). The weight is read in blocks
// of kRowBlock rows, each row's segment [c0, c1) contiguous (a few sequential streams,
// which the hardware prefetchers follow; a panel walk down all K rows was slower from
// DRAM: docs/decisions/0019-weight-row-block-streams.md), chunk by chunk of NB
// columns; every row tile re-reads the chunk from L1.
static void RangeKN(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                    int64_t c0, int64_t c1, float* y, int64_t ka, int64_t kb,
                    int64_t block) {
  // Row tiles of MB rows, or balanced ones when they all keep >= MB - 1 rows (16 rows:
  // 6, 5, 5 rather than 6, 6, 4: tiles of few rows run at a lower FMA rate;
  // docs/decisions/0019-weight-row-block-streams.md).
  const int64_t tiles = (M + MB - 1) / MB;
  const bool balanced = M / tiles >= MB - 1;
  const int64_t full = c0 + (c1 - c0) / NB * NB;
  for (int64_t k0 = ka; k0 < kb; k0 += block) {
    const int64_t k1 = std::min(kb, k0 + block);
    for (int64_t n = c0; n < full; n += NB) {
#if KN_PREFETCH
      // the chunk kPrefetchChunks ahead, every row of the block, into L2: 16 row
      // segments at once are more streams than the hardware prefetchers follow
      // (docs/decisions/0019-weight-row-block-streams.md; one row: no gain)
      if (M > 1 && n + kPrefetchChunks * NB < full)
        for (int64_t k = k0; k < k1; ++k)
          for (int j = 0; j < NB; j += 16)
            __builtin_prefetch(w + k * N + n + kPrefetchChunks * NB + j, 0, 2);
#endif
      for (int64_t t = 0, m = 0; m < M; ++t) {
        const int64_t r = balanced ? M * (t + 1) / tiles - m : std::min<int64_t>(MB, M - m);
        RunRows<KN, MB>(static_cast<int>(r), x + m * K, K, w, N, n, y + m * N, k0, k1, ka);
        m += r;
      }
    }
  }
  int64_t n = full;
  if (n < c1) {  // a last partial panel: plain loops
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = n; c < c1; ++c) y[m * N + c] = 0.0f;
    for (int64_t k = ka; k < kb; ++k)
      for (int64_t m = 0; m < M; ++m) {
        const float a = x[m * K + k];
        for (int64_t c = n; c < c1; ++c) y[m * N + c] += a * w[k * N + c];
      }
  }
}

// y[0:MR, 0:N] += sum over k in [k0, k1) of x[:, k] w[k, :] (w stored [K, N], y at row
// stride ld), KR weight rows a pass: the rows [k0, k1) are read start to end while y
// stays in L1; each loaded weight vector updates all MR rows, and y is loaded and
// stored once per pass. Returns the first k not done (k1 - (k1 - k0) % KR).
template <int MR, int KR>
static int64_t WalkPass(const float* x, int64_t K, const float* w, int64_t N, int64_t k0,
                        int64_t k1, float* y, int64_t ld) {
  constexpr int S = MR == 1 ? 4 : 2;  // vectors of each weight row per step
  const int64_t nv = N / VW * VW;
  int64_t k = k0;
  for (; k + KR <= k1; k += KR) {
    vf a[KR][MR];
#pragma GCC unroll 4
    for (int i = 0; i < KR; ++i)
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) a[i][r] = splat(x[r * K + k + i]);
    const float* wr = w + k * N;
    int64_t n = 0;
    for (; n + S * VW <= nv; n += S * VW) {
      vf b[KR][S];
#pragma GCC unroll 4
      for (int i = 0; i < KR; ++i) {
        __builtin_prefetch(wr + i * N + n + kWalkPrefetch, 0, 2);
#pragma GCC unroll 4
        for (int j = 0; j < S; ++j) b[i][j] = load(wr + i * N + n + j * VW);
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        float* yr = y + r * ld + n;
#pragma GCC unroll 4
        for (int j = 0; j < S; ++j) {
          vf acc = load(yr + j * VW);
#pragma GCC unroll 4
          for (int i = 0; i < KR; ++i) acc = fma(a[i][r], b[i][j], acc);
          store(yr + j * VW, acc);
        }
      }
    }
    for (; n < N; ++n)
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < KR; ++i) y[r * ld + n] += x[r * K + k + i] * wr[i * N + n];
  }
  return k;
}

// Up to kWalkRows rows against w [K, N] with N <= kWalkCols (WalkRowsKN). One row takes
// one weight row a pass, which streamed faster than blocks of rows read together or
// RangeKN's column panels (docs/decisions/0020-one-row-weight-walk.md). Wider weights
// keep the panels (whole rows of [576, 49152] put y out of L1, slower than XLA). Several
// rows walk only with split = 1 ('native_ksplit'): the planner measures the walk against
// the panels ('native') per class.
constexpr int64_t kWalkCols = 4096;  // 16 KiB of y per row
constexpr int64_t kWalkRows = 4;
template <int MR>
static void WalkRowsKN(const float* x, int64_t K, const float* w, int64_t N, int64_t k0,
                       int64_t k1, float* out) {
  // Several rows accumulate at a padded stride: rows N floats apart alias in the low 12
  // address bits when 4·N is a multiple of 2 KiB (SmolLM2's N = 1536 at M = 3, 4), and a
  // load after a store to an aliasing address waits for it ("4K aliasing"). They take
  // four weight rows a pass (a quarter of y's loads and stores;
  // docs/decisions/0020-one-row-weight-walk.md).
  const int64_t ld = MR > 1 ? N + 32 : N;
  std::unique_ptr<float[]> pad(MR > 1 ? new float[MR * ld] : nullptr);
  float* y = MR > 1 ? pad.get() : out;
  std::fill(y, y + MR * ld, 0.0f);
  const int64_t k = MR > 1 ? WalkPass<MR, 4>(x, K, w, N, k0, k1, y, ld) : k0;
  WalkPass<MR, 1>(x, K, w, N, k, k1, y, ld);
  if (MR > 1)
    for (int r = 0; r < MR; ++r) std::memcpy(out + r * N, y + r * ld, N * sizeof(float));
}

template <int R>
struct Walk {
  static void Run(const float* x, int64_t K, const float* w, int64_t N, int64_t,
                  float* y, int64_t k0, int64_t k1, int64_t) {
    WalkRowsKN<R>(x, K, w, N, k0, k1, y);
  }
};

// Weight rows per register tile of the lane-transposed [N, K] product (RangeNKT).
constexpr int NRL = VW == 16 ? 24 : 12;

// y[g0 + i, n0 + j] for i < mg, j < NR, w stored [N, K], the rows of x in the vector
// lanes: xt[k * VW + i] = x[g0 + i, k] (zero beyond mg). Each weight element is
// broadcast once and multiplies all the rows at once: no horizontal sums, every
// weight row read start to end. The next tile's rows are prefetched a line at a time.
template <int NR>
static void TileNKT(const float* xt, int64_t K, const float* w, int64_t N, int64_t n0,
                    int64_t n_end, float* y, int64_t mg) {
  vf acc[NR];
#pragma GCC unroll 32
  for (int j = 0; j < NR; ++j) acc[j] = zero();
  const float* wr = w + n0 * K;
  const bool ahead = n0 + 2 * NR <= n_end;
  for (int64_t k = 0; k < K; ++k) {
    if (ahead && (k & 15) == 0)
#pragma GCC unroll 32
      for (int j = 0; j < NR; ++j) __builtin_prefetch(wr + (NR + j) * K + k, 0, 2);
    const vf xv = load(xt + k * VW);
#pragma GCC unroll 32
    for (int j = 0; j < NR; ++j) acc[j] = fma(splat(wr[j * K + k]), xv, acc[j]);
  }
  alignas(64) float t[NR][VW];
#pragma GCC unroll 32
  for (int j = 0; j < NR; ++j) store(t[j], acc[j]);
  for (int64_t i = 0; i < mg; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + n0 + j] = t[j][i];
}

// Output columns [c0, c1) of y, w stored [N, K], several rows: groups of VW rows in the
// vector lanes (TileNKT), tiles of NRL weight rows.
static void RangeNKT(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                     int64_t c0, int64_t c1, float* y) {
  std::unique_ptr<float[]> xt(new float[K * VW]);
  for (int64_t g0 = 0; g0 < M; g0 += VW) {
    const int64_t mg = std::min<int64_t>(VW, M - g0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < VW; ++i) xt[k * VW + i] = i < mg ? x[(g0 + i) * K + k] : 0.0f;
    float* yg = y + g0 * N;
    int64_t n = c0;
    for (; n + NRL <= c1; n += NRL) TileNKT<NRL>(xt.get(), K, w, N, n, c1, yg, mg);
    for (; n < c1; ++n) TileNKT<1>(xt.get(), K, w, N, n, c1, yg, mg);
  }
}

// y[0:MR, n] for n in [c0, c1), w stored [N, K], K a multiple of 4·VW: each weight
// row read start to end once, as one stream, against all MR rows of x (in L1).
template <int MR>
static void RowDotsNK(const float* x, int64_t K, const float* w, int64_t N, int64_t c0,
                      int64_t c1, float* y) {
  for (int64_t n = c0; n < c1; ++n) {
    const float* wr = w + n * K;
    vf a[MR][4];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = zero();
    for (int64_t k = 0; k < K; k += 4 * VW) {
      const vf b0 = reg(load(wr + k)), b1 = reg(load(wr + k + VW)),
               b2 = reg(load(wr + k + 2 * VW)), b3 = reg(load(wr + k + 3 * VW));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * K + k;
        a[r][0] = fma(load(xr), b0, a[r][0]);
        a[r][1] = fma(load(xr + VW), b1, a[r][1]);
        a[r][2] = fma(load(xr + 2 * VW), b2, a[r][2]);
        a[r][3] = fma(load(xr + 3 * VW), b3, a[r][3]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) y[r * N + n] = hsum((a[r][0] + a[r][1]) + (a[r][2] + a[r][3]));
  }
}

template <int R>
struct Dots {
  static void Run(const float* x, int64_t K, const float* w, int64_t N, int64_t c0,
                  float* y, int64_t c1, int64_t, int64_t) {
    RowDotsNK<R>(x, K, w, N, c0, c1, y);
  }
};

// Output columns [c0, c1) of y, w stored [N, K]. Up to kWalkRows rows read each weight row
// start to end (RowDotsNK): as fast at 2-4 rows as at one, faster than the lanes or tiles
// of NRT rows reading 4 weight rows at once (docs/decisions/0020-one-row-weight-walk.md).
static void RangeNK(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                    int64_t c0, int64_t c1, float* y) {
  int64_t n = c0;
  if (M <= kWalkRows && K % (4 * VW) == 0)
    return RunRows<Dots, kWalkRows>(static_cast<int>(M), x, K, w, N, c0, y, c1);
  for (; n + NRT <= c1; n += NRT) {
    for (int64_t m = 0; m < M; m += MBT) {
      const int r = static_cast<int>(std::min<int64_t>(MBT, M - m));
      RunRows<NK, MBT>(r, x + m * K, K, w, N, n, y + m * N);
    }
  }
  for (; n < c1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      y[m * N + n] = s;
    }
}

// M, K, N of x [M, K] times w [K, N] (nk: w [N, K]) into y [M, N]; false if the ranks
// or shapes disagree.
template <typename D>
static bool Shapes(const D& xd, const D& wd, const D& yd, int64_t nk, int64_t* M,
                   int64_t* K, int64_t* N) {
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) return false;
  *M = xd[0];
  *K = xd[1];
  *N = nk ? wd[0] : wd[1];
  return (nk ? wd[1] : wd[0]) == *K && yd[0] == *M && yd[1] == *N;
}

// An empty product: nothing to do (M or N is 0) or y = 0 (K = 0). True when handled.
static bool Trivial(int64_t M, int64_t K, int64_t N, float* y) {
  if (M == 0 || N == 0) return true;
  if (K == 0) std::fill(y, y + M * N, 0.0f);
  return K == 0;
}

// A K split: part p of up to ``want`` (each >= 64 weight rows; one part per thread:
// finer parts were slower) runs part(yo, ka, kb), its rows [ka, kb) into its own
// partial y (part 0 into y itself), and the partials are added into y.
template <typename Part>
static void SplitK(ffi::ThreadPool& pool, int64_t want, int64_t M, int64_t K, int64_t N,
                   float* y, Part part) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(want, K / 64));
  const int64_t size = M * N;  // floats of y per part
  std::unique_ptr<float[]> partial(parts > 1 ? new float[(parts - 1) * size] : nullptr);
  float* pp = partial.get();
  kvjax_native::ParallelFor(pool, parts, [=](int64_t p) {
    part(p ? pp + (p - 1) * size : y, K * p / parts, K * (p + 1) / parts);
  });
  for (int64_t p = 1; p < parts; ++p)
    for (int64_t i = 0; i < size; ++i) y[i] += pp[(p - 1) * size + i];
}

// y[M, N] = xp[M, K] times the weight (RowsMatmulImpl's split rules).
static void Rows(ffi::ThreadPool& pool, const float* xp, const float* wp, float* yp,
                 int64_t M, int64_t K, int64_t N, int64_t w_nk, int64_t threads,
                 int64_t split, int64_t lanes) {
  const int64_t want = (K * N >= kMinSplit) ? std::max<int64_t>(1, threads) : 1;
  if (!w_nk && (split || (M == 1 && N <= kWalkCols))) {
    // A K split (SplitK). One row, or with split = 1 up to kWalkRows rows, walks its
    // weight rows start to end (WalkRowsKN); more rows (split = 1) take every column in
    // blocks of kSplitRowBlock rows (RangeKN).
    const bool walk = M <= kWalkRows && N <= kWalkCols;
    SplitK(pool, want, M, K, N, yp, [=](float* yo, int64_t ka, int64_t kb) {
      if (walk)
        RunRows<Walk, kWalkRows>(static_cast<int>(M), xp, K, wp, N, 0, yo, ka, kb, 0);
      else
        RangeKN(xp, M, K, wp, N, 0, N, yo, ka, kb, kSplitRowBlock);
    });
    return;
  }
  // Units of work: column panels (w_nk = 0) or groups of NRT weight rows (w_nk = 1).
  const int64_t unit = w_nk ? NRT : NB;
  const int64_t units = (N + unit - 1) / unit;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(want, units));
  kvjax_native::ParallelFor(pool, parts, [=](int64_t p) {
    const int64_t u0 = units * p / parts, u1 = units * (p + 1) / parts;
    const int64_t c0 = u0 * unit, c1 = std::min(N, u1 * unit);
    if (w_nk && M > 1 && lanes)
      RangeNKT(xp, M, K, wp, N, c0, c1, yp);
    else if (w_nk)
      RangeNK(xp, M, K, wp, N, c0, c1, yp);
    else
      RangeKN(xp, M, K, wp, N, c0, c1, yp, 0, K, kRowBlock);
  });
}

ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                          int64_t w_nk, int64_t threads, int64_t split, int64_t lanes) {
  int64_t M, K, N;
  if (!Shapes(x.dimensions(), w.dimensions(), y->dimensions(), w_nk, &M, &K, &N))
    return ffi::Error::InvalidArgument(
        "kvjax_rows_matmul: x [M, K], w [K, N] (w_nk: [N, K]) and y [M, N] expected");
  float* yp = y->typed_data();
  if (Trivial(M, K, N, yp)) return ffi::Error::Success();
  Rows(pool, x.typed_data(), w.typed_data(), yp, M, K, N, w_nk, threads, split, lanes);
  return ffi::Error::Success();
}

// y = RMSNorm(x; g, eps) times the weight: each row of x scaled by 1 / sqrt(mean(x^2) +
// eps) and by g (Zhang & Sennrich 2019, as kvjax.models.layers.RMSNorm) into a buffer of
// M x K floats (in L1/L2 for a decode step's few rows), then the product above. The
// norm's two XLA fusions before each weight product (its sum of squares, its scaling)
// run here instead: two thunks fewer per norm
// (docs/decisions/0042-rmsnorm-in-the-rows-kernel.md).
ffi::Error RowsMatmulNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> w,
                              ffi::ResultBuffer<ffi::F32> y, int64_t w_nk, int64_t threads,
                              int64_t split, int64_t lanes, float eps) {
  int64_t M, K, N;
  if (!Shapes(x.dimensions(), w.dimensions(), y->dimensions(), w_nk, &M, &K, &N) ||
      g.dimensions().size() != 1 || g.dimensions()[0] != K)
    return ffi::Error::InvalidArgument(
        "kvjax_rows_matmul_norm: x [M, K], g [K], w [K, N] (w_nk: [N, K]) and y [M, N] "
        "expected");
  float* yp = y->typed_data();
  if (Trivial(M, K, N, yp)) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* gp = g.typed_data();
  std::unique_ptr<float[]> xn(new float[M * K]);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    vf a0 = zero(), a1 = zero();  // the sum of squares in vectors, two chains
    int64_t k = 0;
    for (; k + 2 * VW <= K; k += 2 * VW) {
      const vf v0 = load(xr + k), v1 = load(xr + k + VW);
      a0 = fma(v0, v0, a0);
      a1 = fma(v1, v1, a1);
    }
    float ss = hsum(a0 + a1);
    for (; k < K; ++k) ss += xr[k] * xr[k];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
    for (k = 0; k < K; ++k) xn[m * K + k] = xr[k] * r * gp[k];
  }
  Rows(pool, xn.get(), w.typed_data(), yp, M, K, N, w_nk, threads, split, lanes);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- int8 weights
// y[M, N] = x[M, K] @ q[K, N] (q_nk = 0) or x @ q[N, K]^T (q_nk = 1), q int8, y before
// the per-output-column scale (the caller multiplies it: kvjax.models.weight_matmul's
// Int8Weight). The weight is a quarter of float32's bytes; each loaded vector of int8
// is widened to float32 in registers (vpmovsxbd + vcvtdq2ps) once and multiplies all M
// rows. Few rows (a draft model's decode step); one thread part per contiguous range
// of K rows (kn: partial y per part, added at the end) or of output rows (nk).
#if defined(__AVX512F__)
static inline vf loadq(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline vf loadq(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
static inline vf loadq(const int8_t* p) {
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
#endif

// y[0, n] += sum over j < 4 of x[k + j] q[k + j, n] for the vectors of n in [0, nv), one
// row (M = 1): x's four elements broadcast once per pass, not once per vector, and two
// vectors of y a step (no loop over rows inside the loop over n;
// docs/decisions/0021-int8-weight-walk.md).
static inline void Int8Row4KN(const float* x, const int8_t* w0, int64_t N, int64_t nv,
                              bool pf, float* y) {
  const vf x0 = splat(x[0]), x1 = splat(x[1]), x2 = splat(x[2]), x3 = splat(x[3]);
  int64_t n = 0;
  for (; n + 2 * VW <= nv; n += 2 * VW) {
    if (pf && (n & 63) == 0) {  // a line of each row two passes ahead
      __builtin_prefetch(w0 + 8 * N + n, 0, 2);
      __builtin_prefetch(w0 + 9 * N + n, 0, 2);
      __builtin_prefetch(w0 + 10 * N + n, 0, 2);
      __builtin_prefetch(w0 + 11 * N + n, 0, 2);
    }
    vf a0 = fma(x0, loadq(w0 + n), load(y + n));
    vf a1 = fma(x0, loadq(w0 + n + VW), load(y + n + VW));
    a0 = fma(x1, loadq(w0 + N + n), a0);
    a1 = fma(x1, loadq(w0 + N + n + VW), a1);
    a0 = fma(x2, loadq(w0 + 2 * N + n), a0);
    a1 = fma(x2, loadq(w0 + 2 * N + n + VW), a1);
    a0 = fma(x3, loadq(w0 + 3 * N + n), a0);
    a1 = fma(x3, loadq(w0 + 3 * N + n + VW), a1);
    store(y + n, a0);
    store(y + n + VW, a1);
  }
  for (; n < nv; n += VW) {
    vf a0 = fma(x0, loadq(w0 + n), load(y + n));
    a0 = fma(x1, loadq(w0 + N + n), a0);
    a0 = fma(x2, loadq(w0 + 2 * N + n), a0);
    store(y + n, fma(x3, loadq(w0 + 3 * N + n), a0));
  }
}

// y[0:M, 0:N] = sum over k in [k0, k1) of x[:, k] q[k, :] (q [K, N]); y M x N floats.
// Four weight rows at a time, so y is loaded and stored once per four rows
// (docs/decisions/0021-int8-weight-walk.md).
static void Int8RowsKN(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t N,
                       int64_t k0, int64_t k1, float* y) {
  std::fill(y, y + M * N, 0.0f);
  const int64_t nv = N / VW * VW;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const int8_t* w0 = q + k * N;
    if (M == 1) Int8Row4KN(x + k, w0, N, nv, k + 12 <= k1, y);  // (its vectors of n)
    else for (int64_t n = 0; n < nv; n += VW) {
      if (k + 12 <= k1 && (n & 63) == 0) {  // a line of each row two passes ahead
        __builtin_prefetch(w0 + 8 * N + n, 0, 2);
        __builtin_prefetch(w0 + 9 * N + n, 0, 2);
        __builtin_prefetch(w0 + 10 * N + n, 0, 2);
        __builtin_prefetch(w0 + 11 * N + n, 0, 2);
      }
      const vf b0 = reg(loadq(w0 + n)), b1 = reg(loadq(w0 + N + n));
      const vf b2 = reg(loadq(w0 + 2 * N + n)), b3 = reg(loadq(w0 + 3 * N + n));
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K + k;
        float* yr = y + m * N + n;
        vf acc = fma(splat(xr[0]), b0, load(yr));
        acc = fma(splat(xr[1]), b1, acc);
        acc = fma(splat(xr[2]), b2, acc);
        store(yr, fma(splat(xr[3]), b3, acc));
      }
    }
    for (int64_t n = nv; n < N; ++n)
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j) y[m * N + n] += x[m * K + k + j] * w0[j * N + n];
  }
  for (; k < k1; ++k) {
    const int8_t* wr = q + k * N;
    int64_t n = 0;
    for (; n < nv; n += VW) {
      const vf b = reg(loadq(wr + n));
      for (int64_t m = 0; m < M; ++m) {
        float* yr = y + m * N + n;
        store(yr, fma(splat(x[m * K + k]), b, load(yr)));
      }
    }
    for (; n < N; ++n)
      for (int64_t m = 0; m < M; ++m) y[m * N + n] += x[m * K + k] * wr[n];
  }
}

// y[:, n] for n in [n0, n1) (q [N, K]): dot products, four output rows at a time (four
// independent accumulator chains sharing each load of x, four weight streams, one
// horizontal sum each at the end), the rows four ahead prefetched a line at a time.
static void Int8RowsNK(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t N,
                       int64_t n0, int64_t n1, float* y) {
  const int64_t kv = K / VW * VW;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const int8_t* w0 = q + n * K;
    const bool ahead = n + 8 <= n1;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      vf a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
      int64_t k = 0;
      for (; k < kv; k += VW) {
        if (m == 0 && ahead && (k & 63) == 0) {
          __builtin_prefetch(w0 + 4 * K + k, 0, 2);
          __builtin_prefetch(w0 + 5 * K + k, 0, 2);
          __builtin_prefetch(w0 + 6 * K + k, 0, 2);
          __builtin_prefetch(w0 + 7 * K + k, 0, 2);
        }
        const vf xv = load(xr + k);
        a0 = fma(xv, loadq(w0 + k), a0);
        a1 = fma(xv, loadq(w0 + K + k), a1);
        a2 = fma(xv, loadq(w0 + 2 * K + k), a2);
        a3 = fma(xv, loadq(w0 + 3 * K + k), a3);
      }
      float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
      for (; k < K; ++k)
        for (int j = 0; j < 4; ++j) s[j] += xr[k] * w0[j * K + k];
      for (int j = 0; j < 4; ++j) y[m * N + n + j] = s[j];
    }
  }
  for (; n < n1; ++n) {
    const int8_t* wr = q + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      vf a0 = zero();
      int64_t k = 0;
      for (; k < kv; k += VW) a0 = fma(load(xr + k), loadq(wr + k), a0);
      float s = hsum(a0);
      for (; k < K; ++k) s += xr[k] * wr[k];
      y[m * N + n] = s;
    }
  }
}

ffi::Error RowsMatmulInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S8> q, ffi::ResultBuffer<ffi::F32> y,
                              int64_t q_nk, int64_t threads) {
  int64_t M, K, N;
  if (!Shapes(x.dimensions(), q.dimensions(), y->dimensions(), q_nk, &M, &K, &N))
    return ffi::Error::InvalidArgument(
        "kvjax_rows_matmul_int8: x [M, K], q [K, N] (q_nk: [N, K]) and y [M, N] expected");
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  float* yp = y->typed_data();
  if (Trivial(M, K, N, yp)) return ffi::Error::Success();
  const int64_t want = (K * N >= 4 * kMinSplit) ? std::max<int64_t>(1, threads) : 1;
  if (q_nk) {
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(want, N));
    kvjax_native::ParallelFor(pool, parts, [=](int64_t p) {
      Int8RowsNK(xp, M, K, qp, N, N * p / parts, N * (p + 1) / parts, yp);
    });
    return ffi::Error::Success();
  }
  SplitK(pool, want, M, K, N, yp, [=](float* yo, int64_t ka, int64_t kb) {
    Int8RowsKN(xp, M, K, qp, N, ka, kb, yo);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxRowsMatmul, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("w_nk")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("split")
                                  .Attr<int64_t>("lanes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxRowsMatmulNorm, RowsMatmulNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("w_nk")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("split")
                                  .Attr<int64_t>("lanes")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxRowsMatmulInt8, RowsMatmulInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("q_nk")
                                  .Attr<int64_t>("threads"));
