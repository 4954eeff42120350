// Grouped-query decode attention over a KV cache, one XLA FFI custom call (CPU, float32).
//
// For each batch row b and KV head k, the G query heads of the group read each cached key
// and value row once (a block of slots stays in L1 while all G heads use it), with an
// online softmax (Milakov & Gimelshein 2018; flash-decoding's split of the slot axis,
// Dao et al. 2023) so the cache is streamed exactly once. Work items (b, k, slot chunk)
// are spread over XLA's intra-op threads (pool.h); the partial results of a (b, k) are
// merged at the end.
//
// Inputs:  q [B, K, G, H] f32; keys [B, K, S, H] (k_bksh=1) or [B, K, H, S] (k_bksh=0)
//          f32; values [B, K, S, V] (v_bksh=1) or [B, K, V, S] f32; visible [B, S] pred.
// Outputs: o [B, K, G, V] f32 = sum_s exp(q.k_s*scale - m) v_s over visible slots,
//          m [B, K, G] f32 = max visible score (-1e30 when no slot is visible),
//          l [B, K, G] f32 = sum_s exp(score_s - m) (0 when no slot is visible).
// The caller merges (o, m, l) with the new token's own score (kvjax/models/decode_kernels.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "pool.h"
#include "xla/ffi/api/ffi.h"
#include "fast_math.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -1e30f;
constexpr int64_t kBlock = 64;  // slots per block (scores of a block stay in L1)


struct Shape {
  int64_t B, K, G, H, V, S;
  bool k_bksh, v_bksh;
  float scale;
};

// What every (b, k) work item starts from: its slices of the keys, values and
// visibility, its G query rows pre-multiplied by the scale, and the statistics reset
// (m = -1e30, l = 0, o = 0).
struct ItemStart {
  const float* kb;
  const float* vb;
  const bool* visb;
  std::vector<float> qs;
};
static ItemStart StartItem(const Shape& sh, const float* q, const float* kc,
                           const float* vc, const bool* vis, int64_t b, int64_t k,
                           float* m, float* l, float* o) {
  const int64_t G = sh.G, H = sh.H, V = sh.V, S = sh.S, bk = b * sh.K + k;
  ItemStart st{kc + bk * S * H, vc + bk * S * V, vis + b * S, std::vector<float>(G * H)};
  const float* qg = q + bk * G * H;
  for (int64_t i = 0; i < G * H; ++i) st.qs[i] = qg[i] * sh.scale;
  for (int64_t g = 0; g < G; ++g) { m[g] = kNegInf; l[g] = 0.0f; }
  std::fill(o, o + G * V, 0.0f);
  return st;
}

// One (b, k, [s0, s1)) work item: writes m[G], l[G], o[G*V].
static void Item(const Shape& sh, const float* q, const float* kc, const float* vc,
                 const bool* vis, int64_t b, int64_t k, int64_t s0, int64_t s1,
                 float* m, float* l, float* o) {
  const int64_t G = sh.G, H = sh.H, V = sh.V, S = sh.S;
  const auto [kb, vb, visb, qs] = StartItem(sh, q, kc, vc, vis, b, k, m, l, o);
  std::vector<float> sc(G * kBlock);
  for (int64_t sb = s0; sb < s1; sb += kBlock) {
    const int64_t n = std::min(kBlock, s1 - sb);
    bool any = false;
    for (int64_t j = 0; j < n; ++j) any |= visb[sb + j];
    if (!any) continue;
    // Scores of the block: sc[g * kBlock + j].
    if (sh.k_bksh) {
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = kb + (sb + j) * H;
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qs.data() + g * H;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t h = 0; h < H; ++h) acc += qr[h] * kr[h];
          sc[g * kBlock + j] = acc;
        }
      }
    } else {
      for (int64_t g = 0; g < G; ++g) std::fill(&sc[g * kBlock], &sc[g * kBlock] + n, 0.0f);
      for (int64_t h = 0; h < H; ++h) {
        const float* kr = kb + h * S + sb;
        for (int64_t g = 0; g < G; ++g) {
          const float qv = qs[g * H + h];
          float* sr = &sc[g * kBlock];
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) sr[j] += qv * kr[j];
        }
      }
    }
    // Online softmax: running max, rescale, unnormalised weights in sc.
    for (int64_t g = 0; g < G; ++g) {
      float* sr = &sc[g * kBlock];
      float bmax = kNegInf;
      for (int64_t j = 0; j < n; ++j)
        if (visb[sb + j]) bmax = std::max(bmax, sr[j]);
      const float mnew = std::max(m[g], bmax);
      if (mnew > m[g]) {
        const float a = fast_exp(m[g] - mnew);
        l[g] *= a;
        float* og = o + g * V;
#pragma omp simd
        for (int64_t h = 0; h < V; ++h) og[h] *= a;
        m[g] = mnew;
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float e = fast_exp(sr[j] - mnew);
        sr[j] = visb[sb + j] ? e : 0.0f;
        sum += sr[j];
      }
      l[g] += sum;
    }
    // Values of the block; masked slots are skipped, so they contribute nothing whatever
    // they hold (a weight of 0 times a NaN or inf value is NaN; issue 32).
    if (sh.v_bksh) {
      for (int64_t j = 0; j < n; ++j) {
        if (!visb[sb + j]) continue;
        const float* vr = vb + (sb + j) * V;
        for (int64_t g = 0; g < G; ++g) {
          const float p = sc[g * kBlock + j];
          float* og = o + g * V;
#pragma omp simd
          for (int64_t h = 0; h < V; ++h) og[h] += p * vr[h];
        }
      }
    } else {
      for (int64_t h = 0; h < V; ++h) {
        const float* vr = vb + h * S + sb;
        for (int64_t g = 0; g < G; ++g) {
          const float* pr = &sc[g * kBlock];
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < n; ++j) acc += visb[sb + j] ? pr[j] * vr[j] : 0.0f;
          o[g * V + h] += acc;
        }
      }
    }
  }
}


// ---------------------------------------------------------------------------------------
// The fast path: keys [B, K, H, S] (the CPU default, kvjax/backend.py), H a multiple of
// the vector width VL; values [B, K, S, V] with V a multiple of VL, or [B, K, V, S].
//
// Read pattern first (measured on a 2-core AMD EPYC, one thread, 128 MiB of keys, read
// only): walking [H, S] in 64-slot blocks (64 strided 256-byte pieces) reads at 5-9 GB/s;
// 8 rows at a time over 4,096 slots (16 KiB contiguous per row) at ~25 GB/s, near a plain
// sequential read (~28-30 GB/s). So the slot axis is taken in spans of up to kSpan
// slots: scores of a span are accumulated 8 key rows at a time into sc[G][span] (kept in
// L2), then one online-softmax update per span (Milakov & Gimelshein 2018), then the
// values of the span, row by row, with the G heads' accumulators in registers (a value
// vector is loaded once and used by every head of the group: the G heads cost FMAs, not
// cache reads).
#if defined(__AVX512F__)
constexpr int VL = 16;
constexpr int kAcc = 24;    // accumulators kept in registers (of 32 zmm)
#else
constexpr int VL = 8;
constexpr int kAcc = 12;    // of 16 ymm
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
static inline vf ld(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void st(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
// Keeps a loaded vector in a register: without it GCC folds the load into every FMA that
// uses it (one load per head instead of one per row), and the loop becomes load-bound.
static inline vf reg(vf x) {
#if defined(__GNUC__)
  asm("" : "+x"(x));
#endif
  return x;
}
static inline vf bc(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(x));
#elif defined(__AVX__)
  return reinterpret_cast<vf>(_mm256_set1_ps(x));
#else
  return vf{} + x;
#endif
}
static inline float hsum(vf x) { float s = 0.0f; for (int i = 0; i < VL; ++i) s += x[i]; return s; }
static inline float hmax(vf x) { float s = x[0]; for (int i = 1; i < VL; ++i) s = std::max(s, x[i]); return s; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// fast_exp (fast_math.h) on a vector; round-to-nearest by adding and removing 1.5 * 2^23.
static inline vf vexp(vf x) {
  x = vmax(x, bc(-87.0f));
  const vf magic = bc(12582912.0f);
  vf n = (x * 1.44269504088896341f + magic) - magic;
  vf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const vf p = fast_exp_poly(r);
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

constexpr int64_t kSpan = 4096;  // slots per span (a multiple of VL)
// Floats between the end of one head's row of sc and the next head's: rows a multiple of
// 4 KiB apart fall in the same L1 sets as each other and as the key rows (whose stride S
// is one too), more lines than the 8 ways hold. One thread, SpanScores on a 4,096-slot
// span in L2, AMD EPYC (AVX-512): G = 8 162 -> 45 us with 48 floats of padding (G = 3:
// 32 -> 22 us); 16 / 32 / 64 / 80 / 144 floats: 85 / 53 / 45 / 43 / 57 us.
constexpr int64_t kScorePad = 48;
constexpr int kRows = 8;         // key rows walked together
constexpr int64_t kSub = 64;     // slots per value sub-block (stays in L1 across groups)

// sc[g * ld_sc + j] = q_g . k[:, j], j in [0, n) (n a multiple of VL), for the G heads at
// qs (pre-scaled, [G, H]); key row h at kp + h * ks.
static void SpanScores(const float* qs, int64_t G, int64_t H, const float* kp, int64_t ks,
                       int64_t n, float* sc, int64_t ld_sc) {
  int64_t h = 0;
  for (; h + kRows <= H; h += kRows) {
    const float* kr = kp + h * ks;
    // The next block of key rows is prefetched into L2 while this one is used, one line
    // per row every 16 slots (the hardware prefetchers lag 8 strided rows). Whole kernel,
    // t = 32K from DRAM, 2 threads, AMD EPYC: G = 8 21.3 -> 24.6 GB/s with kScorePad,
    // 26.7 with the prefetch; G = 4 31.3 -> 32.0 -> 34.9.
    const bool pf = h + 2 * kRows <= H;
    for (int64_t j = 0; j < n; j += VL) {
      if (pf && j % 16 == 0)
        for (int r = 0; r < kRows; ++r) __builtin_prefetch(kr + (kRows + r) * ks + j, 0, 2);
      vf k[kRows];
      for (int r = 0; r < kRows; ++r) k[r] = reg(ld(kr + r * ks + j));
      for (int64_t g = 0; g < G; ++g) {
        const float* q = qs + g * H + h;
        vf a = h ? ld(sc + g * ld_sc + j) : vf{};
        for (int r = 0; r < kRows; ++r) a += bc(q[r]) * k[r];
        st(sc + g * ld_sc + j, a);
      }
    }
  }
  for (; h < H; ++h) {
    for (int64_t j = 0; j < n; j += VL) {
      const vf k = ld(kp + h * ks + j);
      for (int64_t g = 0; g < G; ++g) {
        vf a = h ? ld(sc + g * ld_sc + j) : vf{};
        st(sc + g * ld_sc + j, a + bc(qs[g * H + h]) * k);
      }
    }
  }
}

// o[gi][c0 .. c0 + NV*VL) += sum_{j < n} p[gi * ld_p + j] * v[j][...] for GB heads;
// value row j at vp + j * vs. NV*GB <= kAcc accumulators in registers.
// Rows j with mk[j] == 0 (masked slots) are skipped when mk is given: they contribute
// nothing whatever they hold (issue 32).
template <int GB, int NV>
static void ValuesRows(const float* p, int64_t ld_p, const float* vp, int64_t vs, int64_t n,
                       int64_t c0, float* o, int64_t V, const float* mk) {
  vf acc[GB][NV];
  for (int gi = 0; gi < GB; ++gi)
    for (int c = 0; c < NV; ++c) acc[gi][c] = ld(o + gi * V + c0 + c * VL);
  for (int64_t j = 0; j < n; ++j) {
    if (mk && mk[j] == 0.0f) continue;
    vf v[NV];
    for (int c = 0; c < NV; ++c) v[c] = reg(ld(vp + j * vs + c0 + c * VL));
    for (int gi = 0; gi < GB; ++gi) {
      const vf pb = bc(p[gi * ld_p + j]);
      for (int c = 0; c < NV; ++c) acc[gi][c] += pb * v[c];
    }
  }
  for (int gi = 0; gi < GB; ++gi)
    for (int c = 0; c < NV; ++c) st(o + gi * V + c0 + c * VL, acc[gi][c]);
}

template <int NV>
static void ValuesRowsNV(int64_t gb, const float* p, int64_t ld_p, const float* vp,
                         int64_t vs, int64_t n, int64_t c0, float* o, int64_t V,
                         const float* mk) {
  switch (gb) {
    case 1: ValuesRows<1, NV>(p, ld_p, vp, vs, n, c0, o, V, mk); break;
    case 2: if constexpr (2 * NV <= kAcc) { ValuesRows<2, NV>(p, ld_p, vp, vs, n, c0, o, V, mk); } break;
    case 3: if constexpr (3 * NV <= kAcc) { ValuesRows<3, NV>(p, ld_p, vp, vs, n, c0, o, V, mk); } break;
    case 4: if constexpr (4 * NV <= kAcc) { ValuesRows<4, NV>(p, ld_p, vp, vs, n, c0, o, V, mk); } break;
    case 5: if constexpr (5 * NV <= kAcc) { ValuesRows<5, NV>(p, ld_p, vp, vs, n, c0, o, V, mk); } break;
    default: if constexpr (6 * NV <= kAcc) { ValuesRows<6, NV>(p, ld_p, vp, vs, n, c0, o, V, mk); } break;
  }
}

static bool FastPathApplies(const Shape& sh) {
#if defined(__AVX__)
  return !sh.k_bksh && sh.H % VL == 0 && sh.V % VL == 0;
#else
  return false;  // without AVX the vectors above are emulated: the loops of Item() win
#endif
}

// Item() for FastPathApplies shapes: same inputs, outputs and semantics.
static void FastItem(const Shape& sh, const float* q, const float* kc, const float* vc,
                     const bool* vis, int64_t b, int64_t k, int64_t s0, int64_t s1,
                     float* m, float* l, float* o) {
  const int64_t G = sh.G, H = sh.H, V = sh.V, S = sh.S;
  const auto [kb, vb, visb, qs] = StartItem(sh, q, kc, vc, vis, b, k, m, l, o);
  // Span length: sc[G][span] <= 256 KiB, a multiple of VL, no longer than the item's
  // slots (rounded up to VL): the buffers below are zeroed per item, and a batch of short
  // rows (B = 16, S = 256) has many short items; rows ld_sc apart.
  const int64_t span = std::max<int64_t>(
      VL, std::min<int64_t>({kSpan, 65536 / G, (s1 - s0 + VL - 1) / VL * VL}) / VL * VL);
  const int64_t ld_sc = span + kScorePad;
  std::vector<float> sc(G * ld_sc), mask(span);
  std::vector<float> kpad, vpad;  // a span whose length is not a multiple of VL, padded
  // Value columns per pass and heads per group: NV vectors of columns, gmax heads.
  const int64_t nv_all = V / VL;
  const int nv = nv_all % 4 == 0 && kAcc >= 4 ? 4 : (nv_all % 2 == 0 ? 2 : 1);
  const int64_t gcap = std::min<int64_t>(6, kAcc / nv);
  const int64_t gmax = (G + (G + gcap - 1) / gcap - 1) / ((G + gcap - 1) / gcap);  // balanced groups
  for (int64_t sb = s0; sb < s1; sb += span) {
    const int64_t n = std::min(span, s1 - sb);
    const int64_t np = (n + VL - 1) / VL * VL;
    int64_t nvis = 0;
    for (int64_t j = 0; j < n; ++j) {
      mask[j] = visb[sb + j] ? 1.0f : 0.0f;
      nvis += visb[sb + j];
    }
    if (nvis == 0) continue;
    for (int64_t j = n; j < np; ++j) mask[j] = 0.0f;
    const float* kp = kb + sb;
    int64_t ks = S;
    const float* vp = sh.v_bksh ? vb + sb * V : vb + sb;
    int64_t vs = sh.v_bksh ? V : S;
    if (np != n) {  // copy the ragged end so vector loads stay inside the buffers
      kpad.assign(H * np, 0.0f);
      for (int64_t h = 0; h < H; ++h) std::memcpy(&kpad[h * np], kp + h * S, n * 4);
      kp = kpad.data();
      ks = np;
      if (sh.v_bksh) {
        vpad.assign(np * V, 0.0f);
        std::memcpy(vpad.data(), vp, n * V * 4);
      } else {
        vpad.assign(V * np, 0.0f);
        for (int64_t c = 0; c < V; ++c) std::memcpy(&vpad[c * np], vp + c * S, n * 4);
        vs = np;
      }
      vp = vpad.data();
    }
    SpanScores(qs.data(), G, H, kp, ks, np, sc.data(), ld_sc);
    // Online softmax per head over the span; unnormalised probabilities into sc, and o
    // rescaled to the new running max (Milakov & Gimelshein 2018).
    for (int64_t g = 0; g < G; ++g) {
      float* sr = &sc[g * ld_sc];
      vf bm = bc(kNegInf);
      for (int64_t j = 0; j < np; j += VL)
        bm = vmax(bm, ld(&mask[j]) > 0.0f ? ld(sr + j) : bc(kNegInf));
      const float mnew = std::max(m[g], hmax(bm));
      const float alpha = fast_exp(m[g] - mnew);  // m = -1e30 before any slot: o, l are 0
      for (int64_t c = 0; c < V; ++c) o[g * V + c] *= alpha;
      vf sum = vf{};
      for (int64_t j = 0; j < np; j += VL) {
        // a select, not a product with the mask: a masked score may be NaN or inf
        const vf e = ld(&mask[j]) > 0.0f ? vexp(ld(sr + j) - mnew) : vf{};
        st(sr + j, e);
        sum += e;
      }
      l[g] = l[g] * alpha + hsum(sum);
      m[g] = mnew;
    }
    if (sh.v_bksh) {
      // Sub-blocks of kSub slots: the first group reads them from memory, the others
      // (and other column passes) from L1.
      for (int64_t j0 = 0; j0 < np; j0 += kSub) {
        const int64_t nj = std::min(kSub, np - j0);
        // Masked slots are skipped (issue 32): a sub-block with none visible is not read,
        // one with some masked passes the mask so that their rows are skipped.
        int64_t sub_vis = 0;
        for (int64_t j = j0; j < j0 + nj; ++j) sub_vis += mask[j] != 0.0f;
        if (sub_vis == 0) continue;
        const float* mk = sub_vis == nj ? nullptr : &mask[j0];
        for (int64_t g0 = 0; g0 < G; g0 += gmax) {
          const int64_t gb = std::min(gmax, G - g0);
          const float* pp = sc.data() + g0 * ld_sc + j0;
          const float* vv = vp + j0 * vs;
          float* oo = o + g0 * V;
          for (int64_t c0 = 0; c0 < V; c0 += nv * VL) {
            if (nv == 4) ValuesRowsNV<4>(gb, pp, ld_sc, vv, vs, nj, c0, oo, V, mk);
            else if (nv == 2) ValuesRowsNV<2>(gb, pp, ld_sc, vv, vs, nj, c0, oo, V, mk);
            else ValuesRowsNV<1>(gb, pp, ld_sc, vv, vs, nj, c0, oo, V, mk);
          }
        }
      }
    } else {
      // Values [V, S]: o[g][c] += sum_j p[g][j] v[c][j], 4 value rows at a time. A span
      // with masked slots selects its values by the mask (issue 32: 0 x NaN is NaN).
      if (nvis < n) {
        for (int64_t g = 0; g < G; ++g) {
          const float* p = &sc[g * ld_sc];
          float* og = o + g * V;
          for (int64_t c = 0; c < V; ++c) {
            vf a0{};
            for (int64_t j = 0; j < np; j += VL)
              a0 += ld(p + j) * (ld(&mask[j]) > 0.0f ? ld(vp + c * vs + j) : vf{});
            og[c] += hsum(a0);
          }
        }
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* p = &sc[g * ld_sc];
        float* og = o + g * V;
        int64_t c = 0;
        for (; c + 4 <= V; c += 4) {
          vf a0{}, a1{}, a2{}, a3{};
          const float* v0 = vp + c * vs;
          for (int64_t j = 0; j < np; j += VL) {
            const vf pj = ld(p + j);
            a0 += pj * ld(v0 + j);
            a1 += pj * ld(v0 + vs + j);
            a2 += pj * ld(v0 + 2 * vs + j);
            a3 += pj * ld(v0 + 3 * vs + j);
          }
          og[c] += hsum(a0);
          og[c + 1] += hsum(a1);
          og[c + 2] += hsum(a2);
          og[c + 3] += hsum(a3);
        }
        for (; c < V; ++c) {
          vf a0{};
          for (int64_t j = 0; j < np; j += VL) a0 += ld(p + j) * ld(vp + c * vs + j);
          og[c] += hsum(a0);
        }
      }
    }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc,
                               ffi::Buffer<ffi::F32> vc, ffi::Buffer<ffi::PRED> vis,
                               ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                               ffi::ResultBuffer<ffi::F32> l, int64_t k_bksh, int64_t v_bksh,
                               float scale, int64_t threads) {
  auto qd = q.dimensions();
  auto kd = kc.dimensions();
  auto vd = vc.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || vis.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("kvjax_decode_attention: q, k, v must be rank 4, visible rank 2");
  Shape sh{qd[0], qd[1], qd[2], qd[3], v_bksh ? vd[3] : vd[2], k_bksh ? kd[2] : kd[3],
           k_bksh != 0, v_bksh != 0, scale};
  if ((k_bksh ? kd[3] : kd[2]) != sh.H || (v_bksh ? vd[2] : vd[3]) != sh.S ||
      kd[0] != sh.B || kd[1] != sh.K || vd[0] != sh.B || vd[1] != sh.K ||
      vis.dimensions()[0] != sh.B || vis.dimensions()[1] != sh.S)
    return ffi::Error::InvalidArgument("kvjax_decode_attention: inconsistent shapes");
  const int64_t G = sh.G, V = sh.V;
  const int64_t heads = sh.B * sh.K;
  // Chunks of the slot axis: enough work items for every thread, each >= 4 blocks.
  const int64_t nthreads = std::max<int64_t>(1, threads);
  int64_t chunks = std::max<int64_t>(1, (2 * nthreads + heads - 1) / heads);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, sh.S / (4 * kBlock)));
  const int64_t chunk = ((sh.S + chunks - 1) / chunks + kBlock - 1) / kBlock * kBlock;
  chunks = (sh.S + chunk - 1) / chunk;
  const int64_t items = heads * chunks;
  std::vector<float> pm(items * G), pl(items * G), po(items * G * V);
  const float* qp = q.typed_data();
  const float* kp = kc.typed_data();
  const float* vp = vc.typed_data();
  const bool* visp = vis.typed_data();
  const bool parallel = nthreads > 1 && items > 1 &&
                        sh.S * sh.H * heads >= (int64_t{1} << 16);
  // Items in contiguous ranges over XLA's intra-op pool (pool.h; an OpenMP team would
  // spin on the cores XLA's own threads need between calls).
  const int64_t parts = parallel ? std::min(nthreads, items) : 1;
  const bool fast = FastPathApplies(sh);
  kvjax_native::ParallelFor(pool, parts, [&](int64_t p) {
    for (int64_t it = items * p / parts; it < items * (p + 1) / parts; ++it) {
      const int64_t bk = it / chunks, c = it % chunks;
      const int64_t s0 = c * chunk, s1 = std::min(sh.S, s0 + chunk);
      (fast ? FastItem : Item)(sh, qp, kp, vp, visp, bk / sh.K, bk % sh.K, s0, s1,
                               &pm[it * G], &pl[it * G], &po[it * G * V]);
    }
  });
  float* om = m->typed_data();
  float* ol = l->typed_data();
  float* oo = o->typed_data();
  for (int64_t bk = 0; bk < heads; ++bk) {
    for (int64_t g = 0; g < G; ++g) {
      float mx = kNegInf;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, pm[(bk * chunks + c) * G + g]);
      float lsum = 0.0f;
      float* og = oo + (bk * G + g) * V;
      std::fill(og, og + V, 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t it = bk * chunks + c;
        if (pl[it * G + g] == 0.0f) continue;
        const float a = fast_exp(pm[it * G + g] - mx);
        lsum += a * pl[it * G + g];
        const float* pg = &po[(it * G + g) * V];
        for (int64_t h = 0; h < V; ++h) og[h] += a * pg[h];
      }
      om[bk * G + g] = mx;
      ol[bk * G + g] = lsum;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k_bksh")
                                  .Attr<int64_t>("v_bksh")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads"));
