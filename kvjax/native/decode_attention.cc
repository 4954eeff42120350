// Grouped-query decode attention over a KV cache, one XLA FFI custom call (CPU, float32).
//
// For each batch row b and KV head k, the G query heads of the group read each cached key
// and value row once from memory (a block of slots stays in registers or L1 while all G
// heads use it), with an
// online softmax (Milakov & Gimelshein 2018; flash-decoding's split of the slot axis,
// Dao et al. 2023) so the cache is streamed exactly once. Work items (b, k, slot chunk)
// are spread over XLA's intra-op threads (pool.h); the partial results of a (b, k) are
// merged at the end.
//
// Two targets share every loop below:
//  * kvjax_decode_attention, a dense cache:
//    q [B, K, G, H] f32; keys [B, K, S, H] (k_bksh=1) or [B, K, H, S] (k_bksh=0) f32;
//    values [B, K, S, V] (v_bksh=1) or [B, K, V, S] f32; visible [B, S] pred.
//  * kvjax_paged_decode_attention, a paged cache read in place (vLLM's PagedAttention,
//    Kwon et al. 2023, sec. 4.1): keys [N, K, P, H] or [N, K, H, P] and values
//    [N, K, P, V] or [N, K, V, P] are pools of N pages of P slots; block_table [B, M] s32
//    names the page of each row's logical page (-1: none, its slots must be invisible);
//    visible [B, M*P] pred over the row's logical slots (slot j = page j / P, offset j % P).
//    A dense cache is the paged one with P = S and row b's table [b].
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

#if defined(KVJAX_TRACE_PARTS)
#include <chrono>
#include <mutex>
#include <thread>
#endif

#include "pool.h"
#include "xla/ffi/api/ffi.h"
#include "fast_math.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -1e30f;
constexpr int64_t kBlock = 64;  // slots per block (scores of a block stay in L1)


struct Shape {
  int64_t B, K, G, H, V, S;  // S: slots of a row (dense) or of its M logical pages (M * P)
  int64_t P, M;              // slots per page, pages per row (dense: P = S, M = 1)
  const int32_t* bt;         // [B, M] page of each logical page, -1: none (dense: nullptr)
  bool k_bksh, v_bksh;
  float scale;
  bool blocks;               // grouped dense runs swept block by block (BlockSweep)
};

// The page holding row b's logical slot s (-1: none; dense: page b, the row itself).
static inline int64_t PageOf(const Shape& sh, int64_t b, int64_t s) {
  return sh.bt ? sh.bt[b * sh.M + s / sh.P] : b;
}

// Start of page pg's slice for KV head k in a pool of X floats per slot ([N, K, P, X] or
// [N, K, X, P]: P * X contiguous floats either way).
static inline const float* PageBase(const Shape& sh, const float* pool, int64_t pg,
                                    int64_t k, int64_t X) {
  return pool + (pg * sh.K + k) * sh.P * X;
}

// What every (b, k) work item starts from: its row of the visibility, its G query rows
// pre-multiplied by the scale, and the statistics reset (m = -1e30, l = 0, o = 0).
struct ItemStart {
  const bool* visb;
  std::vector<float> qs;
};
static ItemStart StartItem(const Shape& sh, const float* q, const bool* vis, int64_t b,
                           int64_t k, float* m, float* l, float* o) {
  const int64_t G = sh.G, H = sh.H, V = sh.V, bk = b * sh.K + k;
  ItemStart st{vis + b * sh.S, std::vector<float>(G * H)};
  const float* qg = q + bk * G * H;
  for (int64_t i = 0; i < G * H; ++i) st.qs[i] = qg[i] * sh.scale;
  for (int64_t g = 0; g < G; ++g) { m[g] = kNegInf; l[g] = 0.0f; }
  std::fill(o, o + G * V, 0.0f);
  return st;
}

// One (b, k, [s0, s1)) work item: writes m[G], l[G], o[G*V]. Blocks never cross a page.
static void Item(const Shape& sh, const float* q, const float* kc, const float* vc,
                 const bool* vis, int64_t b, int64_t k, int64_t s0, int64_t s1,
                 float* m, float* l, float* o) {
  const int64_t G = sh.G, H = sh.H, V = sh.V, P = sh.P;
  const auto [visb, qs] = StartItem(sh, q, vis, b, k, m, l, o);
  std::vector<float> sc(G * kBlock);
  int64_t n = 0;
  for (int64_t sb = s0; sb < s1; sb += n) {
    const int64_t off = sb % P;
    n = std::min({kBlock, s1 - sb, P - off});
    const bool any = std::memchr(visb + sb, 1, n) != nullptr;
    const int64_t pg = PageOf(sh, b, sb);
    if (!any || pg < 0) continue;  // a slot on no page counts as invisible
    const float* kb = PageBase(sh, kc, pg, k, H);
    const float* vb = PageBase(sh, vc, pg, k, V);
    // Scores of the block: sc[g * kBlock + j].
    if (sh.k_bksh) {
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = kb + (off + j) * H;
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
        const float* kr = kb + h * P + off;
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
        const float* vr = vb + (off + j) * V;
        for (int64_t g = 0; g < G; ++g) {
          const float p = sc[g * kBlock + j];
          float* og = o + g * V;
#pragma omp simd
          for (int64_t h = 0; h < V; ++h) og[h] += p * vr[h];
        }
      }
    } else {
      for (int64_t h = 0; h < V; ++h) {
        const float* vr = vb + h * P + off;
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
// Read pattern first: walking [H, S] in 64-slot blocks (64 strided 256-byte pieces), left
// to the hardware prefetchers, reads at a fraction of the bandwidth that 8 rows at a time
// over 4,096 slots (16 KiB contiguous per row) reach, near a plain sequential read
// (docs/decisions/0010-decode-kernel-spans.md). So the slot axis is taken in spans of up
// to kSpan slots: scores of a span into sc[G][span] (kept in L2), accumulated a few key
// rows at a time over long rows (SpanScores), or, for grouped heads (GroupScoresApply), a
// block of slots down the H rows (in passes of 8 rows for up to 4 heads) with every score
// in registers, each head's max found on the way, and the blocks ahead prefetched in
// software (GroupScores; docs/decisions/0033-grouped-decode-blocking.md,
// docs/decisions/0035-grouped-decode-streams.md); then one online-softmax update per
// span (Milakov & Gimelshein 2018), then the values of the span,
// row by row, with the G heads' accumulators in registers (a value vector is loaded once
// and used by every head of the group: the G heads cost FMAs, not cache reads).
#if defined(__AVX512F__)
constexpr int VL = 16;
constexpr int kRegs = 32;   // vector registers (zmm)
#else
constexpr int VL = 8;
constexpr int kRegs = 16;   // ymm
#endif
// Accumulators that stay in registers beside n loaded vectors and one broadcast (AccFor):
// one more and GCC spills one, whose store-to-load round trip each slot then bounds a
// loop that is not waiting on memory (AVX2: ValuesRows over a dense row's run, 3 heads x 4
// vectors = 17 of 16 ymm). kAcc: the loops whose per-slot pointers, tests and prefetches
// hide that spill (the paged and masked paths; no faster at AccFor:
// docs/decisions/0013-decode-values-in-registers.md).
constexpr int AccFor(int n) { return kRegs - n - 1; }
constexpr int kAcc = kRegs == 32 ? 24 : 12;
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
static inline vf ld(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void st(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
// Keeps a loaded vector in a register: without it GCC folds the load into every FMA that
// uses it (one load per head instead of one per row), and the loop becomes load-bound
// (docs/decisions/0017-keep-loads-in-registers.md).
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
#if defined(__AVX512F__)
  // p * 2^n in one instruction, where the bit trick below takes four
  return reinterpret_cast<vf>(_mm512_scalef_ps(reinterpret_cast<__m512>(p),
                                               reinterpret_cast<__m512>(n)));
#else
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
#endif
}

constexpr int64_t kSpan = 4096;  // slots per span (a multiple of VL)
constexpr int64_t kScFloats = 65536;  // floats of a span's scores, sc[G][span]
// Floats between the end of one head's row of sc and the next head's: rows a multiple of
// 4 KiB apart fall in the same L1 sets as each other and as the key rows (whose stride S
// is one too), more lines than the 8 ways hold; 48 floats of padding scored fastest
// (docs/decisions/0011-decode-score-padding.md).
constexpr int64_t kScorePad = 48;
constexpr int kRows = 8;         // key rows walked together
constexpr int kNC = 4;           // chunks of VL slots scored together (ChunkScores)
constexpr int64_t kLong = 8 * VL;  // segments at least this long stream by SpanScores
constexpr int64_t kPfChunks = 2 * kNC;  // chunks ahead whose keys are prefetched
constexpr int64_t kPfRows = 16;  // value rows ahead that are prefetched (ValuesRows)
constexpr int64_t kSub = 64;     // slots per value sub-block (stays in L1 across groups)

// One block of SpanScores' blocked walk: key rows [h, h + R) of slots [j, j + NJ*VL) held
// in R*NJ registers, each head's NJ score vectors loaded from sc, advanced by R rows and
// stored back. A broadcast of q serves NJ vectors of keys, so a head costs R + NJ loads
// and one store for R*NJ FMAs (R = 8, NJ = 1: 9 loads and a store for 8).
template <int R, int NJ>
static inline void ScoresBlock(const float* qs, int64_t G, int64_t H, int64_t h,
                               const float* kr, int64_t ks, int64_t j, float* sc,
                               int64_t ld_sc) {
  vf k[R][NJ];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NJ; ++c) k[r][c] = reg(ld(kr + r * ks + j + c * VL));
  for (int64_t g = 0; g < G; ++g) {
    const float* q = qs + g * H + h;
    float* out = sc + g * ld_sc + j;
    vf a[NJ];
    for (int c = 0; c < NJ; ++c) a[c] = h ? ld(out + c * VL) : vf{};
    for (int r = 0; r < R; ++r) {
      const vf qb = bc(q[r]);
      for (int c = 0; c < NJ; ++c) a[c] += qb * k[r][c];
    }
    for (int c = 0; c < NJ; ++c) st(out + c * VL, a[c]);
  }
}

// Segments at least this long (a dense row's span) take SpanScores' blocked walk: 4 key
// rows x 3 vectors of slots, no software prefetch (the hardware prefetchers follow 4 long
// rows). Shorter ones (pages of 64-1,023 slots) walk 8 rows a vector at a time with the
// next 8 rows prefetched: a page's rows are short, and the blocked walk read them slower
// (docs/decisions/0012-decode-blocked-scores.md).
constexpr int64_t kBlockedScores = 1024;
constexpr int kScoreRows = 4, kScoreVecs = 3;

// sc[g * ld_sc + j] = q_g . k[:, j], j in [0, n) (n a multiple of VL), for the G heads at
// qs (pre-scaled, [G, H]); key row h at kp + h * ks.
static void SpanScores(const float* qs, int64_t G, int64_t H, const float* kp, int64_t ks,
                       int64_t n, float* sc, int64_t ld_sc) {
  int64_t h = 0;
  if (n >= kBlockedScores) {
    for (; h + kScoreRows <= H; h += kScoreRows) {
      const float* kr = kp + h * ks;
      int64_t j = 0;
      for (; j + kScoreVecs * VL <= n; j += kScoreVecs * VL)
        ScoresBlock<kScoreRows, kScoreVecs>(qs, G, H, h, kr, ks, j, sc, ld_sc);
      for (; j < n; j += VL) ScoresBlock<kScoreRows, 1>(qs, G, H, h, kr, ks, j, sc, ld_sc);
    }
  }
  for (; h + kRows <= H; h += kRows) {
    const float* kr = kp + h * ks;
    // The next block of key rows is prefetched into L2 while this one is used, one line
    // per row every 16 slots (the hardware prefetchers lag 8 strided rows;
    // docs/decisions/0011-decode-score-padding.md).
    const bool pf = h + 2 * kRows <= H;
    for (int64_t j = 0; j < n; j += VL) {
      if (pf && j % 16 == 0)
        for (int r = 0; r < kRows; ++r) __builtin_prefetch(kr + (kRows + r) * ks + j, 0, 2);
      ScoresBlock<kRows, 1>(qs, G, H, h, kr, ks, j, sc, ld_sc);
    }
  }
  for (; h < H; ++h)
    for (int64_t j = 0; j < n; j += VL) ScoresBlock<1, 1>(qs, G, H, h, kp + h * ks, ks, j, sc, ld_sc);
}

// A grouped row's scores with every accumulator in registers
// (docs/decisions/0033-grouped-decode-blocking.md): a block of NJ vectors of slots is
// walked down the H key rows (a pass of rows at a time: GroupScoresGB); each key vector
// is loaded once and used by the GB heads of the group (GB * NJ FMAs for NJ loads and GB
// broadcasts), and the GB * NJ score vectors are stored once, after the pass's last row.
// NJ is the most vectors that fit beside the accumulators, a key block and a broadcast
// (GroupNJ). A block some blocks ahead is prefetched into L2 a line per row as this one
// is walked: the strided rows are more streams than the hardware prefetchers follow.
constexpr int GroupNJ(int gb) { return std::min(8, (kRegs - 2) / (gb + 1)); }
// Heads walked together: AVX-512 9 heads x 3 vectors (27 accumulators); AVX2 6 x 2 (12).
constexpr int kGroupMax = kRegs == 32 ? 9 : 6;
constexpr int64_t kPfAhead = 2;
constexpr int64_t kPassRows = 8;  // key rows a pass of GroupScoresGB walks, up to 4 heads

// mk (nullptr: none): the float mask of the block's slots; each head's running max over
// its visible scores is then folded into bmax[g * VL, (g + 1) * VL) while the scores are
// still in registers, so the softmax needs no pass to find it (SpanSoftmax).
// Rows [h0, h1) of the block: the scores start from sc when h0 > 0 (an earlier pass's).
template <int GB, int NJ>
static inline void GroupScoresBlock(const float* qs, int64_t H, int64_t h0, int64_t h1,
                                    const float* kp, int64_t ks, float* sc, int64_t ld_sc,
                                    const float* pf, const float* mk, float* bmax) {
  vf acc[GB][NJ];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NJ; ++c) acc[g][c] = h0 ? ld(sc + g * ld_sc + c * VL) : vf{};
  constexpr int kLines = NJ * VL / 16 ? NJ * VL / 16 : 1;  // 64-byte lines of a row's block
  for (int64_t h = h0; h < h1; ++h) {
    const float* kr = kp + h * ks;
    if (pf)
      for (int c = 0; c < kLines; ++c) __builtin_prefetch(pf + h * ks + c * 16, 0, 2);
    vf k[NJ];
    for (int c = 0; c < NJ; ++c) k[c] = reg(ld(kr + c * VL));
    for (int g = 0; g < GB; ++g) {
      const vf qb = bc(qs[g * H + h]);
      for (int c = 0; c < NJ; ++c) acc[g][c] += qb * k[c];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NJ; ++c) st(sc + g * ld_sc + c * VL, acc[g][c]);
  if (!mk) return;
  for (int g = 0; g < GB; ++g) {
    vf bm = ld(bmax + g * VL);
    // a select, not a product with the mask: a masked score may be NaN or inf
    for (int c = 0; c < NJ; ++c) bm = vmax(bm, ld(mk + c * VL) > 0.0f ? acc[g][c] : bc(kNegInf));
    st(bmax + g * VL, bm);
  }
}

// sc[g * ld_sc + j] = q_g . k[:, j], j in [0, n) (n a multiple of VL), for GB heads at qs
// ([GB, H], pre-scaled); key row h at kp + h * ks; with mk, the running maxima into bmax
// (GroupScoresBlock). In passes of `rows` key rows, the block `ahead` blocks on
// prefetched; after(j, w) runs once a block [j, j + w) has its scores (on the last pass:
// BlockSweep's softmax and values).
template <int GB, class After>
static void GroupScoresWalk(const float* qs, int64_t H, const float* kp, int64_t ks,
                            int64_t n, float* sc, int64_t ld_sc, const float* mk,
                            float* bmax, int64_t rows, int64_t ahead, After after) {
  constexpr int NJ = GroupNJ(GB);
  constexpr int64_t W = NJ * VL;
  for (int64_t h0 = 0; h0 < H; h0 += rows) {
    const int64_t h1 = std::min(H, h0 + rows);
    const bool last = h1 == H;
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      // Near a pass's end the blocks prefetched are the next pass's first (the last pass:
      // the next span's rows [0, rows), or nothing useful; a prefetch never faults).
      const int64_t jj = j + ahead * W;
      const float* pf = jj < n ? kp + jj : last ? kp + jj - h0 * ks : kp + jj - n + rows * ks;
      GroupScoresBlock<GB, NJ>(qs, H, h0, h1, kp + j, ks, sc + j, ld_sc, pf,
                               last && mk ? mk + j : nullptr, bmax);
      if (last) after(j, W);
    }
    for (; j < n; j += VL) {
      GroupScoresBlock<GB, 1>(qs, H, h0, h1, kp + j, ks, sc + j, ld_sc, nullptr,
                              last && mk ? mk + j : nullptr, bmax);
      if (last) after(j, VL);
    }
  }
}

// Up to 4 heads (FMAs to spare per key byte) walk the span in passes of kPassRows key
// rows, the scores reloaded from sc between passes, the block 4 ahead prefetched: 8
// strided streams read faster than 64 (docs/decisions/0035-grouped-decode-streams.md).
// More heads walk all H rows in one pass: their scores' reloads would cost FMA slots.
constexpr int64_t PassRows(int gb, int64_t H) { return gb <= 4 ? kPassRows : H; }
constexpr int64_t PassAhead(int gb) { return gb <= 4 ? 2 * kPfAhead : kPfAhead; }

template <int GB>
static void GroupScoresGB(const float* qs, int64_t H, const float* kp, int64_t ks, int64_t n,
                          float* sc, int64_t ld_sc, const float* mk, float* bmax) {
  GroupScoresWalk<GB>(qs, H, kp, ks, n, sc, ld_sc, mk, bmax, PassRows(GB, H), PassAhead(GB),
                      [](int64_t, int64_t) {});
}

// Whether G heads are scored by GroupScores, else by SpanScores. AVX-512: G > 1 (G = 1:
// SpanScores' long rows read faster than a one-head block). AVX2's 16 registers leave a
// block of 1-3 vectors a key row: over all H rows at once that strided walk read slower
// than SpanScores (docs/decisions/0033-grouped-decode-blocking.md), in passes of 8 rows
// faster for G = 2-3 only (docs/decisions/0035-grouped-decode-streams.md).
static inline bool GroupScoresApply(int64_t G) {
  return G > 1 && (kRegs == 32 || G <= 3);
}

// GroupScoresGB for any G: groups of at most kGroupMax heads, balanced; a later group
// reads the span's keys again (from L2 when the span is short enough). mk (nullptr:
// none): the float mask of slots [0, n); each head g's running max over its visible
// scores is then folded into bmax[g * VL, (g + 1) * VL).
static void GroupScores(const float* qs, int64_t G, int64_t H, const float* kp, int64_t ks,
                        int64_t n, float* sc, int64_t ld_sc, const float* mk = nullptr,
                        float* bmax = nullptr) {
  const int64_t ngroups = (G + kGroupMax - 1) / kGroupMax;
  for (int64_t i = 0, g0 = 0; i < ngroups; ++i) {
    const int64_t gb = (G - g0) / (ngroups - i);
    const float* q = qs + g0 * H;
    float* out = sc + g0 * ld_sc;
    float* bm = bmax ? bmax + g0 * VL : nullptr;
    switch (gb) {
#define KVJAX_GROUP(N) \
  case N: if constexpr (N <= kGroupMax) GroupScoresGB<N>(q, H, kp, ks, n, out, ld_sc, mk, bm); break;
      KVJAX_GROUP(1) KVJAX_GROUP(2) KVJAX_GROUP(3) KVJAX_GROUP(4) KVJAX_GROUP(5)
      KVJAX_GROUP(6) KVJAX_GROUP(7) KVJAX_GROUP(8) KVJAX_GROUP(9)
#undef KVJAX_GROUP
    }
    g0 += gb;
  }
}

// Scores of NC chunks of VL slots, each wherever its page lies (key row h of chunk c at
// kp[c] + h * ks): out[c][g * ld_sc + i] = q_g . k_c[:, i] for the G heads at qs ([G, H],
// pre-scaled). The kAcc / NC heads' accumulators stay in registers over all H rows and
// the NC chunks are loaded side by side, so a page of a few vectors costs no reload of sc
// (SpanScores reloads it every kRows rows) and its lines are fetched with the other
// chunks' in parallel. pf[c] (nullptr: none) is a chunk read later, prefetched one line
// per row: a page's first lines miss otherwise (the hardware prefetchers follow a stream
// inside a 4 KiB page, not from one pool page to the next).
template <int NC>
static void ChunkScores(const float* qs, int64_t G, int64_t H, const float* const* kp,
                        int64_t ks, float* const* out, int64_t ld_sc,
                        const float* const* pf) {
  constexpr int kG = kAcc / NC;
  for (int64_t g0 = 0; g0 < G; g0 += kG) {
    const int64_t gb = std::min<int64_t>(kG, G - g0);
    vf acc[kG][NC];
    for (int gi = 0; gi < kG; ++gi)
      for (int c = 0; c < NC; ++c) acc[gi][c] = vf{};
    for (int64_t h = 0; h < H; ++h) {
      vf k[NC];
      for (int c = 0; c < NC; ++c) k[c] = reg(ld(kp[c] + h * ks));
      if (g0 == 0)
        for (int c = 0; c < NC; ++c)
          if (pf[c]) __builtin_prefetch(pf[c] + h * ks, 0, 3);
      for (int gi = 0; gi < kG; ++gi) {
        if (gi >= gb) break;
        const vf qv = bc(qs[(g0 + gi) * H + h]);
        for (int c = 0; c < NC; ++c) acc[gi][c] += qv * k[c];
      }
    }
    for (int gi = 0; gi < gb; ++gi)
      for (int c = 0; c < NC; ++c) st(out[c] + (g0 + gi) * ld_sc, acc[gi][c]);
  }
}

// o[gi][c0 .. c0 + NV*VL) += sum_{j < n} p[gi * ld_p + j] * rows[j][...] for GB heads
// (rows[j]: the value row of slot j, wherever its page lies). NV*GB accumulators in
// registers (<= AccFor(NV) for kContig, else <= kAcc). Masked slots have no row (nullptr)
// and are skipped: they contribute nothing whatever they hold (issue 32). rows[j +
// kPfRows] is prefetched while j + kPfRows < npf (the rows the caller holds; 0: no
// prefetch), the same columns: a page's first rows miss otherwise (see ChunkScores).
// kContig: every row visible and row j at rows[0] + j * V (a dense row's run): no
// per-slot pointer or test, which left AVX2 issuing more scalar than vector work per
// slot; npf != 0: this is call pf_call of the npf calls that read the sub-block (head
// groups, column passes), and the next sub-block's rows (kSub slots on) are prefetched
// whole into L2, a row every npf slots of every call, so the DRAM stream goes on at an
// even rate through all the calls' FMAs; a single call (npf = 0) leaves the stream to the
// hardware prefetchers (docs/decisions/0033-grouped-decode-blocking.md,
// docs/decisions/0035-grouped-decode-streams.md).
template <int GB, int NV, bool kContig>
static void ValuesRows(const float* p, int64_t ld_p, const float* const* rows, int64_t n,
                       int64_t npf, int64_t c0, float* o, int64_t V, int64_t pf_call) {
  vf acc[GB][NV];
  for (int gi = 0; gi < GB; ++gi)
    for (int c = 0; c < NV; ++c) acc[gi][c] = ld(o + gi * V + c0 + c * VL);
  const float* vr = kContig ? rows[0] : nullptr;
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (kContig) {
      if (j) vr += V;
      if (npf && (pf_call * n + j) % npf == 0) {  // a whole row of the next sub-block
        const float* nr = rows[0] + (kSub + (pf_call * n + j) / npf) * V;
        for (int64_t c = 0; c < V; c += 16) __builtin_prefetch(nr + c, 0, 2);
      }
    } else {
      if (j + kPfRows < npf && rows[j + kPfRows])
        for (int c = 0; c < NV; ++c) __builtin_prefetch(rows[j + kPfRows] + c0 + c * VL, 0, 3);
      vr = rows[j];
      if (!vr) continue;
    }
    vf v[NV];
    for (int c = 0; c < NV; ++c) v[c] = reg(ld(vr + c0 + c * VL));
    for (int gi = 0; gi < GB; ++gi) {
      const vf pb = bc(p[gi * ld_p + j]);
      for (int c = 0; c < NV; ++c) acc[gi][c] += pb * v[c];
    }
  }
  for (int gi = 0; gi < GB; ++gi)
    for (int c = 0; c < NV; ++c) st(o + gi * V + c0 + c * VL, acc[gi][c]);
}

template <int NV, bool kContig>
static void ValuesRowsNV(int64_t gb, const float* p, int64_t ld_p, const float* const* rows,
                         int64_t n, int64_t npf, int64_t c0, float* o, int64_t V,
                         int64_t pf_call) {
#define KVJAX_VALUES_ROWS(GB) \
  ValuesRows<GB, NV, kContig>(p, ld_p, rows, n, npf, c0, o, V, pf_call)
  switch (gb) {
    case 1: KVJAX_VALUES_ROWS(1); break;
    case 2: if constexpr (2 * NV <= (kContig ? AccFor(NV) : kAcc)) { KVJAX_VALUES_ROWS(2); } break;
    case 3: if constexpr (3 * NV <= (kContig ? AccFor(NV) : kAcc)) { KVJAX_VALUES_ROWS(3); } break;
    case 4: if constexpr (4 * NV <= (kContig ? AccFor(NV) : kAcc)) { KVJAX_VALUES_ROWS(4); } break;
    case 5: if constexpr (5 * NV <= (kContig ? AccFor(NV) : kAcc)) { KVJAX_VALUES_ROWS(5); } break;
    default: if constexpr (6 * NV <= (kContig ? AccFor(NV) : kAcc)) { KVJAX_VALUES_ROWS(6); } break;
  }
#undef KVJAX_VALUES_ROWS
}

template <bool kContig>
static void ValuesRowsAny(int nv, int64_t gb, const float* p, int64_t ld_p,
                          const float* const* rows, int64_t n, int64_t npf, int64_t c0,
                          float* o, int64_t V, int64_t pf_call = 0) {
  if (nv == 4) ValuesRowsNV<4, kContig>(gb, p, ld_p, rows, n, npf, c0, o, V, pf_call);
  else if (nv == 2) ValuesRowsNV<2, kContig>(gb, p, ld_p, rows, n, npf, c0, o, V, pf_call);
  else ValuesRowsNV<1, kContig>(gb, p, ld_p, rows, n, npf, c0, o, V, pf_call);
}

// Value columns per pass and heads per group (docs/decisions/0013-decode-values-in-registers.md):
// the widest NV of 4, 2 or 1 vectors dividing V / VL (ValueVectors); G heads in groups of
// at most `cap`, balanced (HeadsPerGroup); over a dense row's run (contiguous rows) as many
// heads as fit beside NV loaded vectors, at most 6 (ContigHeads: AVX-512 6 heads x 4
// vectors, AVX2 2 x 4).
static inline int ValueVectors(int64_t V) {
  const int64_t n = V / VL;
  return n % 4 == 0 ? 4 : (n % 2 == 0 ? 2 : 1);
}
constexpr int64_t HeadsPerGroup(int64_t G, int64_t cap) {
  const int64_t groups = (G + cap - 1) / cap;
  return (G + groups - 1) / groups;
}
static inline int64_t ContigHeads(int nv) { return std::max(1, std::min(6, AccFor(nv) / nv)); }

// The online softmax of a span (Milakov & Gimelshein 2018), per head g: the running max
// m[g] over the scores sc[g * ld_sc + j] of slots j in [lo, hi) whose mask[j] > 0, o[g]
// and l[g] rescaled to it, the unnormalised probabilities written over the scores (0 on
// masked slots and on [np, np + VL), past the span), l[g] += their sum. bmax (nullptr:
// none): each head's maximum over those slots already folded into bmax[g * VL, (g + 1) *
// VL) by the scores (GroupScores), so no pass finds it here. The heads are taken VL at a
// time: their rescales are one vector exponential, and each slot vector's mask is loaded
// once for all of them (docs/decisions/0035-grouped-decode-streams.md).
static void SpanSoftmax(int64_t G, int64_t V, float* scp, int64_t ld_sc, const float* mask,
                        int64_t lo, int64_t hi, int64_t np, float* m, float* l, float* o,
                        const float* bmax = nullptr) {
  for (int64_t g0 = 0; g0 < G; g0 += VL) {
    const int64_t gb = std::min<int64_t>(VL, G - g0);
    vf mold = vf{}, mnew = vf{};  // lanes past the heads: exp(0 - 0)
    for (int64_t gi = 0; gi < gb; ++gi) {
      const int64_t g = g0 + gi;
      vf bm = bc(kNegInf);
      if (bmax) {
        bm = ld(bmax + g * VL);
      } else {
        const float* sr = &scp[g * ld_sc];
        for (int64_t j = lo; j < hi; j += VL)
          bm = vmax(bm, ld(&mask[j]) > 0.0f ? ld(sr + j) : bc(kNegInf));
      }
      mold[gi] = m[g];
      mnew[gi] = std::max(m[g], hmax(bm));
    }
    // m = -1e30 before any slot: o and l are 0, whatever alpha is
    const vf alpha = vexp(mold - mnew);
    vf sum[VL];
    for (int64_t gi = 0; gi < gb; ++gi) {
      const float a = alpha[gi];
      float* og = o + (g0 + gi) * V;
      for (int64_t c = 0; c < V; c += VL) st(og + c, ld(og + c) * a);
      sum[gi] = vf{};
    }
    for (int64_t j = lo; j < hi; j += VL) {
      // a select, not a product with the mask: a masked score may be NaN or inf
      const auto vis = ld(&mask[j]) > 0.0f;
      for (int64_t gi = 0; gi < gb; ++gi) {
        float* sr = &scp[(g0 + gi) * ld_sc];
        const vf e = vis ? vexp(ld(sr + j) - mnew[gi]) : vf{};
        st(sr + j, e);
        sum[gi] += e;
      }
    }
    for (int64_t gi = 0; gi < gb; ++gi) {
      const int64_t g = g0 + gi;
      std::fill(&scp[g * ld_sc] + np, &scp[g * ld_sc] + np + VL, 0.0f);
      l[g] = l[g] * alpha[gi] + hsum(sum[gi]);
      m[g] = mnew[gi];
    }
  }
}

// ---------------------------------------------------------------------------------------
// The block-by-block form of a grouped dense run ('native_blocks', kvjax/kernels.py): the
// per-block update of flash-decoding (Dao et al. 2023). GroupScoresGB's key walk
// (GroupScoresWalk) in passes of kSweepRows rows, the block kPfAhead on prefetched, and on
// the last pass each block's online softmax and values right after its scores, so the
// value stream runs between the key blocks instead of after a whole span's keys. Passes
// of about 32 rows (H = 64: two of 32), not GroupScoresGB's (8 rows for up to 4 heads,
// all H for more): the value stream then runs beside half the key rows instead of an
// eighth, and the sweep read faster or level for every G
// (docs/decisions/0053-sweep-passes-of-32-rows.md). Which form streams faster is a
// property of the machine's memory system, so the planner times both
// (docs/decisions/0052-grouped-decode-blocks-per-machine.md; decision 0045 measured it).
constexpr int64_t kSweepRows = 32;
// H rows in as few passes of at most kSweepRows as cover them, balanced as HeadsPerGroup
// balances heads (H = 48: two of 24; passes differ by a row at most): a pass prefetches
// the next pass's rows, so a short last pass would leave the prefetches of the one before
// it reaching past row H.
constexpr int64_t SweepRows(int64_t H) { return HeadsPerGroup(H, kSweepRows); }

// One block's online softmax and values, right after its scores: the GB heads' scores of
// w visible slots at sc (row stride ld_sc, in L1: just stored) become unnormalised
// probabilities against each head's running max m[g] (o[g] and l[g] rescaled when it
// grows, Milakov & Gimelshein 2018), then the w contiguous value rows at vp ([w, V]) are
// accumulated into o with every head's columns in registers (ValuesRows; heads in
// balanced groups of at most 6 over 4 vectors, as FastItem's dense runs: a later group
// reads the block's value rows from L1).
template <int GB>
static inline void BlockSoftmaxValues(float* sc, int64_t ld_sc, int64_t w, const float* vp,
                                      int64_t V, int nv, float* m, float* l, float* o) {
  for (int g = 0; g < GB; ++g) {
    float* sr = sc + g * ld_sc;
    vf bm = ld(sr);
    for (int64_t j = VL; j < w; j += VL) bm = vmax(bm, ld(sr + j));
    const float mnew = std::max(m[g], hmax(bm));
    if (mnew > m[g]) {  // m = -1e30 before any slot: o and l are 0, whatever the factor
      const float a = fast_exp(m[g] - mnew);
      l[g] *= a;
      for (int64_t c = 0; c < V; c += VL) st(o + g * V + c, ld(o + g * V + c) * a);
      m[g] = mnew;
    }
    const vf mv = bc(mnew);
    vf sum{};
    for (int64_t j = 0; j < w; j += VL) {
      const vf e = vexp(ld(sr + j) - mv);
      st(sr + j, e);
      sum += e;
    }
    l[g] += hsum(sum);
  }
  const int64_t gmax = HeadsPerGroup(GB, ContigHeads(nv));
  for (int64_t g0 = 0; g0 < GB; g0 += gmax)
    for (int64_t c0 = 0; c0 < V; c0 += nv * VL)
      ValuesRowsAny<true>(nv, std::min(gmax, GB - g0), sc + g0 * ld_sc, ld_sc, &vp, w, 0,
                          c0, o + g0 * V, V);
}

// GB heads at qs ([GB, H], pre-scaled) over a dense run of n slots (n a multiple of VL),
// every slot visible: key row h at kp + h * ks, values [n, V] at vp; sc ([GB, ld_sc],
// ld_sc >= n) holds the scores between passes; m, l, o updated as by SpanSoftmax and
// the values.
template <int GB>
static void BlockSweepGB(const float* qs, int64_t H, const float* kp, int64_t ks,
                         const float* vp, int64_t V, int64_t n, float* sc, int64_t ld_sc,
                         float* m, float* l, float* o, int64_t pass_rows, int64_t ahead) {
  const int nv = ValueVectors(V);
  GroupScoresWalk<GB>(qs, H, kp, ks, n, sc, ld_sc, nullptr, nullptr, pass_rows, ahead,
                      [&](int64_t j, int64_t w) {
                        BlockSoftmaxValues<GB>(sc + j, ld_sc, w, vp + j * V, V, nv, m, l, o);
                      });
}

// Whether BlockSweep runs G heads: AVX-512 (GroupScores' blocking of up to kGroupMax
// heads at once) and G >= 2; G = 1 and AVX2 keep the phases.
static inline bool BlockSweepApplies(int64_t G) {
  return kRegs == 32 && G >= 2 && G <= kGroupMax;
}

// pass_rows, ahead: the walk's passes and prefetch distance (the kernel: SweepRows(H) and
// kPfAhead; the profile harness varies them).
static void BlockSweep(const float* qs, int64_t G, int64_t H, const float* kp, int64_t ks,
                       const float* vp, int64_t V, int64_t n, float* sc, int64_t ld_sc,
                       float* m, float* l, float* o, int64_t pass_rows, int64_t ahead) {
  switch (G) {
#define KVJAX_SWEEP(N) \
  case N: if constexpr (N <= kGroupMax) \
    BlockSweepGB<N>(qs, H, kp, ks, vp, V, n, sc, ld_sc, m, l, o, pass_rows, ahead); break;
    KVJAX_SWEEP(1) KVJAX_SWEEP(2) KVJAX_SWEEP(3) KVJAX_SWEEP(4) KVJAX_SWEEP(5)
    KVJAX_SWEEP(6) KVJAX_SWEEP(7) KVJAX_SWEEP(8) KVJAX_SWEEP(9)
#undef KVJAX_SWEEP
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
//
// A span of the row's slots lies on one page (dense: the row) or on several (paged);
// each piece of it on one page is a segment, read where it lies: its keys are an [H, n]
// matrix of row stride P, its values [n, V] rows (or [V, n] of stride P). A segment
// whose length is not a multiple of VL (a dense row's ragged end, pages of P % VL != 0)
// is copied into zero-padded buffers so that vector loads stay inside them.
static void FastItem(const Shape& sh, const float* q, const float* kc, const float* vc,
                     const bool* vis, int64_t b, int64_t k, int64_t s0, int64_t s1,
                     float* m, float* l, float* o) {
  const int64_t G = sh.G, H = sh.H, V = sh.V, P = sh.P;
  const auto [visb, qs] = StartItem(sh, q, vis, b, k, m, l, o);
  // Span length: sc[G][span] <= 256 KiB, a multiple of VL, no longer than the item's
  // slots (rounded up to VL); rows ld_sc apart (the padding also holds what a padded
  // segment writes past the span's end, < VL floats).
  const int64_t span = std::max<int64_t>(
      VL, std::min<int64_t>({kSpan, kScFloats / G, (s1 - s0 + VL - 1) / VL * VL}) / VL * VL);
  const int64_t ld_sc = span + kScorePad;
  // The scores, the float mask and the value rows of a span, in buffers each thread keeps
  // from item to item and call to call, neither freed nor zeroed: every float read below
  // was written for this span first (scores and mask over the segments' range, weights
  // by the softmax over [lo, hi), rows over [lo, end)), and scores of masked slots are
  // dropped by selects, never multiplied. What a buffer grows by is poisoned (scores NaN,
  // mask 1: visible), so a read of a float not written for its span shows in the tests.
  // Vectors allocated and zeroed per item (100 KiB at G = 3) were a visible share of a
  // window's time (docs/decisions/0016-decode-scratch-buffers-kept.md).
  thread_local std::vector<float> sc_buf, mask_buf, bmax_buf;
  thread_local std::vector<const float*> rows_buf;
  if (bmax_buf.size() < size_t(G * VL)) bmax_buf.resize(G * VL, std::nanf(""));
  float* const bmax = bmax_buf.data();
  if (sc_buf.size() < size_t(G * ld_sc)) sc_buf.resize(G * ld_sc, std::nanf(""));
  if (mask_buf.size() < size_t(span + 2 * VL)) mask_buf.resize(span + 2 * VL, 1.0f);
  if (rows_buf.size() < size_t(span)) rows_buf.resize(span);
  float* const scp = sc_buf.data();
  float* const mask = mask_buf.data();
  const float** const rows = rows_buf.data();
  std::vector<std::pair<int64_t, int64_t>> nopage;  // a span's slots on no page
  std::vector<float> kpad, vpad;
  std::vector<const float*> ck;
  std::vector<float*> co;
  // Value columns per pass and heads per group: NV vectors of columns, gmax heads
  // (ValueVectors, HeadsPerGroup): over a dense row's run ContigHeads, else kAcc / NV
  // (6 x 4; AVX2 3 x 4); over pages 3 x 4 stayed fastest
  // (docs/decisions/0013-decode-values-in-registers.md).
  const int nv = ValueVectors(V);
  const int64_t gmax_contig = HeadsPerGroup(G, ContigHeads(nv));
  const int64_t gmax_rows = HeadsPerGroup(G, std::min(6, kAcc / nv));
  struct Seg { int64_t j0, n, nvis; const float* kp; const float* vp; };
  std::vector<Seg> segs;
  for (int64_t sb = s0; sb < s1; sb += span) {
    const int64_t n = std::min(span, s1 - sb);
    // A span with no visible slot costs one scan of its flags (a window's mask over a
    // dense row leaves most spans so), not the per-slot masks and segments below.
    if (!std::memchr(visb + sb, 1, n)) continue;
    const int64_t np = (n + VL - 1) / VL * VL;
    const bool* vs = visb + sb;  // the span's flags
    segs.clear();
    nopage.clear();
    for (int64_t j = 0, len = 0; j < n; j += len) {
      const int64_t off = (sb + j) % P, pg = PageOf(sh, b, sb + j);
      len = std::min(n - j, P - off);
      if (pg < 0) {  // a slot on no page counts as invisible
        nopage.push_back({j, j + len});
        continue;
      }
      // Runs of visible slots, cut where kBlock slots in a row are masked (a window and
      // its sinks over a dense row: the keys between them are never read), each widened
      // to whole vectors inside the segment. Found with memchr over the flags: a window
      // of W slots at the end of a 4,096-slot span costs a few scans, not a loop over
      // every slot.
      const float* kb = PageBase(sh, kc, pg, k, H) + off;
      const float* vb = PageBase(sh, vc, pg, k, V) + (sh.v_bksh ? off * V : off);
      for (int64_t i = j, e = j + len; i < e;) {
        const void* f = std::memchr(vs + i, 1, e - i);
        if (!f) break;
        i = static_cast<const bool*>(f) - vs;
        int64_t last = e - 1;
        for (int64_t r = i; r < e;) {
          const void* g = std::memchr(vs + r, 0, e - r);  // the next masked slot
          if (!g) break;
          const int64_t r0 = static_cast<const bool*>(g) - vs;
          last = r0 - 1;
          const int64_t lim = std::min(e, r0 + kBlock);
          const void* h = std::memchr(vs + r0, 1, lim - r0);  // visible again within kBlock?
          if (!h) break;
          r = static_cast<const bool*>(h) - vs;
          last = e - 1;
        }
        const int64_t a = j + (i - j) / VL * VL;
        const int64_t z = std::min(e, j + (last + 1 - j + VL - 1) / VL * VL);
        int64_t cnt = 0;
        for (int64_t x = a; x < z; ++x) cnt += vs[x];
        segs.push_back({a, z - a, cnt, kb + (a - j), vb + (sh.v_bksh ? (a - j) * V : a - j)});
        i = z;
      }
    }
    if (segs.empty()) continue;
    // 'native_blocks': a span of one fully visible dense run of whole vectors (no page
    // boundary, no masked slot) is swept block by block (BlockSweep) instead of in phases.
    if (sh.blocks && sh.v_bksh && BlockSweepApplies(G) && segs.size() == 1 &&
        segs[0].n % VL == 0 && segs[0].n >= kLong && segs[0].nvis == segs[0].n &&
        nopage.empty()) {
      BlockSweep(qs.data(), G, H, segs[0].kp, P, segs[0].vp, V, segs[0].n,
                 scp + segs[0].j0, ld_sc, m, l, o, SweepRows(H), kPfAhead);
      continue;
    }
    // The float mask over the segments' range and a vector past it (the loops below read
    // [lo, hi) a vector at a time, padded segments up to a vector past their end); 0
    // past the span's end and on slots with no page.
    {
      const int64_t m0 = segs.front().j0;
      const int64_t m1 = std::min(np + VL, segs.back().j0 + segs.back().n + 2 * VL);
      for (int64_t j = m0; j < m1; ++j) mask[j] = j < n && vs[j] ? 1.0f : 0.0f;
      for (const auto& [x0, x1] : nopage)
        for (int64_t j = std::max(x0, m0); j < std::min(x1, m1); ++j) mask[j] = 0.0f;
    }
    // Segments of a multiple of VL slots shorter than kLong are cut into chunks of VL
    // slots, scored kNC at a time (ChunkScores) after the others: a padded segment writes
    // up to len - n floats past its end, into the scores of a later segment (written after
    // it) or the span's padding. Longer segments (a dense row) stream by SpanScores.
    ck.clear();
    co.clear();
    // A span of one segment of whole vectors scored by GroupScores (a dense row) has its
    // heads' maxima found by the scores (bmax), not by a pass of the softmax; a padded
    // segment's scores past its end would enter them, so it never does.
    const bool grouped = GroupScoresApply(G);
    const bool fused_max = grouped && segs.size() == 1 &&
                           segs[0].n % VL == 0 && segs[0].n >= kLong;
    if (fused_max) std::fill(bmax, bmax + G * VL, kNegInf);
    for (const Seg& sg : segs) {
      const float* kp = sg.kp;
      int64_t ks = P, len = sg.n;
      float* out = scp + sg.j0;
      if (len % VL == 0 && len < kLong) {
        for (int64_t i = 0; i < len; i += VL) {
          ck.push_back(kp + i);
          co.push_back(out + i);
        }
        continue;
      }
      if (len % VL) {  // copy the segment so vector loads stay inside the buffer
        len = (len + VL - 1) / VL * VL;
        kpad.assign(H * len, 0.0f);
        for (int64_t h = 0; h < H; ++h) std::memcpy(&kpad[h * len], kp + h * P, sg.n * 4);
        kp = kpad.data();
        ks = len;
      }
      // Grouped rows keep every score in registers (GroupScores) where GroupScoresApply.
      if (grouped)
        GroupScores(qs.data(), G, H, kp, ks, len, out, ld_sc,
                    fused_max ? mask + sg.j0 : nullptr, fused_max ? bmax : nullptr);
      else
        SpanScores(qs.data(), G, H, kp, ks, len, out, ld_sc);
    }
    const int64_t nck = ck.size();
    for (int64_t i = 0; i < nck; i += kNC) {
      const float* pf[kNC];
      for (int c = 0; c < kNC; ++c)
        pf[c] = i + kPfChunks + c < nck ? ck[i + kPfChunks + c] : nullptr;
      switch (std::min<int64_t>(kNC, nck - i)) {
        case 4: ChunkScores<4>(qs.data(), G, H, &ck[i], P, &co[i], ld_sc, pf); break;
        case 3: ChunkScores<3>(qs.data(), G, H, &ck[i], P, &co[i], ld_sc, pf); break;
        case 2: ChunkScores<2>(qs.data(), G, H, &ck[i], P, &co[i], ld_sc, pf); break;
        default: ChunkScores<1>(qs.data(), G, H, &ck[i], P, &co[i], ld_sc, pf); break;
      }
    }
    // Online softmax per head over the segments' slots [lo, hi) of the span (the rest is
    // masked); unnormalised probabilities into sc (0 past the span), and o rescaled to the
    // new running max (Milakov & Gimelshein 2018).
    const int64_t lo = segs.front().j0;
    const int64_t hi = std::min(np, (segs.back().j0 + segs.back().n + VL - 1) / VL * VL);
    SpanSoftmax(G, V, scp, ld_sc, mask, lo, hi, np, m, l, o, fused_max ? bmax : nullptr);
    if (sh.v_bksh) {
      // The value row of each visible slot, wherever its page lies (nullptr: masked).
      const int64_t end = std::min(n, hi);
      std::fill(rows + lo, rows + end, nullptr);
      for (const Seg& sg : segs)
        for (int64_t j = sg.j0; j < sg.j0 + sg.n; ++j)
          if (mask[j] != 0.0f) rows[j] = sg.vp + (j - sg.j0) * V;
      // Sub-blocks of kSub slots: the first group reads them from memory, the others (and
      // other column passes) from L1. A sub-block with no visible slot is not read.
      for (int64_t j0 = lo; j0 < end; j0 += kSub) {
        const int64_t nj = std::min(kSub, end - j0);
        bool any = false, contig = true;
        for (int64_t j = j0; j < j0 + nj; ++j) {
          any |= rows[j] != nullptr;
          contig &= rows[j] != nullptr && (j == j0 || rows[j] == rows[j - 1] + V);
        }
        if (!any) continue;
        const int64_t gmax = contig ? gmax_contig : gmax_rows;
        // The next sub-block's value rows are prefetched: over a contiguous run by all
        // of several calls, a row every `calls` slots (ValuesRows); else a share at a time
        // before each call after the first (which reads this sub-block from memory; the
        // others read it from L1): the first call then finds them in cache, not a DRAM
        // stream that no arithmetic overlaps (docs/decisions/0014-decode-values-prefetch.md).
        const int64_t calls = (G + gmax - 1) / gmax * ((V + nv * VL - 1) / (nv * VL));
        const int64_t next = j0 + kSub, next_n = std::min(kSub, end - next);
        const int64_t row_lines = (V + 15) / 16, lines = next_n > 0 ? next_n * row_lines : 0;
        int64_t call = 0;
        for (int64_t g0 = 0; g0 < G; g0 += gmax) {
          const int64_t gb = std::min(gmax, G - g0);
          const float* pp = scp + g0 * ld_sc + j0;
          float* oo = o + g0 * V;
          const int64_t npf = g0 == 0 ? end - j0 : 0;  // the first group reads from memory
          for (int64_t c0 = 0; c0 < V; c0 += nv * VL, ++call) {
            if (contig) {  // several calls share the prefetch of the next sub-block
              ValuesRowsAny<true>(nv, gb, pp, ld_sc, &rows[j0], nj,
                                  calls > 1 && next_n > 0 ? calls : 0, c0, oo, V, call);
              continue;
            }
            if (call > 0 && lines > 0)
              for (int64_t ln = (call - 1) * lines / (calls - 1),
                           ln1 = call * lines / (calls - 1); ln < ln1; ++ln)
                if (const float* r = rows[next + ln / row_lines])
                  __builtin_prefetch(r + ln % row_lines * 16, 0, 3);
            ValuesRowsAny<false>(nv, gb, pp, ld_sc, &rows[j0], nj, npf, c0, oo, V);
          }
        }
      }
      continue;
    }
    // Values [V, n] per segment: o[g][c] += sum_j p[g][j] v[c][j], 4 value rows at a time.
    // A segment with masked slots selects its values by the mask (issue 32: 0 x NaN is
    // NaN). Past a padded segment's end its values are 0 and its weights finite.
    for (const Seg& sg : segs) {
      const float* vp = sg.vp;
      int64_t vs = P, len = sg.n;
      if (len % VL) {
        len = (len + VL - 1) / VL * VL;
        vpad.assign(V * len, 0.0f);
        for (int64_t c = 0; c < V; ++c) std::memcpy(&vpad[c * len], vp + c * P, sg.n * 4);
        vp = vpad.data();
        vs = len;
      }
      const float* mk = &mask[sg.j0];
      for (int64_t g = 0; g < G; ++g) {
        const float* p = &scp[g * ld_sc + sg.j0];
        float* og = o + g * V;
        if (sg.nvis < sg.n) {
          for (int64_t c = 0; c < V; ++c) {
            vf a0{};
            for (int64_t j = 0; j < len; j += VL)
              a0 += ld(p + j) * (ld(mk + j) > 0.0f ? ld(vp + c * vs + j) : vf{});
            og[c] += hsum(a0);
          }
          continue;
        }
        int64_t c = 0;
        for (; c + 4 <= V; c += 4) {
          vf a0{}, a1{}, a2{}, a3{};
          const float* v0 = vp + c * vs;
          for (int64_t j = 0; j < len; j += VL) {
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
          for (int64_t j = 0; j < len; j += VL) a0 += ld(p + j) * ld(vp + c * vs + j);
          og[c] += hsum(a0);
        }
      }
    }
  }
}

#if defined(KVJAX_TRACE_PARTS)
// A diagnostic build (-DKVJAX_TRACE_PARTS; scripts/decode_attention_threads.py) records,
// for each part of each call, which thread ran it and when; KvjaxTraceTake hands the
// records over. Never in the default build.
std::mutex trace_mu;
std::vector<double> trace_rows;  // [part, parts, on a pool thread, start s, end s] each
static void TracePart(int64_t p, int64_t parts, bool pooled,
                      std::chrono::steady_clock::time_point t_call,
                      std::chrono::steady_clock::time_point t_part) {
  const auto now = std::chrono::steady_clock::now();
  const auto secs = [t_call](auto t) { return std::chrono::duration<double>(t - t_call).count(); };
  std::lock_guard<std::mutex> lock(trace_mu);
  trace_rows.insert(trace_rows.end(), {double(p), double(parts), double(pooled),
                                       secs(t_part), secs(now)});
}
#endif

// Both targets: every (b, k, slot chunk) item over the threads, then the chunks of each
// (b, k) merged into o, m, l.
static void Run(ffi::ThreadPool& pool, const Shape& sh, const float* qp, const float* kp,
                const float* vp, const bool* visp, float* oo, float* om, float* ol,
                int64_t threads) {
  const int64_t G = sh.G, V = sh.V;
  const int64_t heads = sh.B * sh.K;
  if (sh.S == 0) {  // no slot (S = 0 or pages of 0 slots): nothing visible
    std::fill(om, om + heads * G, kNegInf);
    std::fill(ol, ol + heads * G, 0.0f);
    std::fill(oo, oo + heads * G * V, 0.0f);
    return;
  }
  // Chunks of the slot axis: enough work items for every thread, each >= 4 blocks.
  const int64_t nthreads = std::max<int64_t>(1, threads);
  int64_t chunks = std::max<int64_t>(1, (2 * nthreads + heads - 1) / heads);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, sh.S / (4 * kBlock)));
  const int64_t chunk = ((sh.S + chunks - 1) / chunks + kBlock - 1) / kBlock * kBlock;
  chunks = (sh.S + chunk - 1) / chunk;
  const int64_t items = heads * chunks;
  // Row b's chunk c is [cut[b][c], cut[b][c + 1]): equal shares of its visible slots, cut
  // at whole blocks (a row with none: equal shares of its slots). Equal slot ranges left
  // a window's work to one chunk of each head: a W = 1,024 draft over 8,200 slots (3 heads,
  // 2 chunks, 2 threads) gave one thread two windows and the other one
  // (docs/decisions/0015-decode-chunks-by-visible-slots.md).
  std::vector<int64_t> cut(sh.B * (chunks + 1));
  for (int64_t b = 0; b < sh.B; ++b) {
    int64_t* cb = &cut[b * (chunks + 1)];
    const bool* vb = visp + b * sh.S;
    cb[0] = 0;
    cb[chunks] = sh.S;
    if (chunks == 1) continue;  // (a batch of many heads: nothing to cut, no scan)
    const int64_t total = std::count(vb, vb + sh.S, true);
    for (int64_t c = 1, s = 0, seen = 0; c < chunks; ++c) {
      if (total == 0) {
        cb[c] = std::min(sh.S, c * chunk);
        continue;
      }
      const int64_t want = (total * c + chunks - 1) / chunks;  // visible slots before cut c
      for (; s < sh.S && seen < want; ++s) seen += vb[s];
      cb[c] = std::max(cb[c - 1], std::min(sh.S, (s + kBlock - 1) / kBlock * kBlock));
    }
  }
  std::vector<float> pm(items * G), pl(items * G), po(items * G * V);
  const bool parallel = nthreads > 1 && items > 1 &&
                        sh.S * sh.H * heads >= (int64_t{1} << 16);
  // Items in contiguous ranges over XLA's intra-op pool (pool.h; an OpenMP team would
  // spin on the cores XLA's own threads need between calls).
  const int64_t parts = parallel ? std::min(nthreads, items) : 1;
  const bool fast = FastPathApplies(sh);
#if defined(KVJAX_TRACE_PARTS)
  const auto t_call = std::chrono::steady_clock::now();
  const auto caller = std::this_thread::get_id();
#endif
  kvjax_native::ParallelFor(pool, parts, [&](int64_t p) {
#if defined(KVJAX_TRACE_PARTS)
    const auto t_part = std::chrono::steady_clock::now();
#endif
    for (int64_t it = items * p / parts; it < items * (p + 1) / parts; ++it) {
      const int64_t bk = it / chunks, c = it % chunks;
      const int64_t* cb = &cut[(bk / sh.K) * (chunks + 1)];
      const int64_t s0 = cb[c], s1 = cb[c + 1];
      (fast ? FastItem : Item)(sh, qp, kp, vp, visp, bk / sh.K, bk % sh.K, s0, s1,
                               &pm[it * G], &pl[it * G], &po[it * G * V]);
    }
#if defined(KVJAX_TRACE_PARTS)
    TracePart(p, parts, std::this_thread::get_id() != caller, t_call, t_part);
#endif
  });
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
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc,
                               ffi::Buffer<ffi::F32> vc, ffi::Buffer<ffi::PRED> vis,
                               ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                               ffi::ResultBuffer<ffi::F32> l, int64_t k_bksh, int64_t v_bksh,
                               float scale, int64_t threads, int64_t blocks) {
  auto qd = q.dimensions();
  auto kd = kc.dimensions();
  auto vd = vc.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || vis.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("kvjax_decode_attention: q, k, v must be rank 4, visible rank 2");
  const int64_t S = k_bksh ? kd[2] : kd[3];
  Shape sh{qd[0], qd[1], qd[2], qd[3], v_bksh ? vd[3] : vd[2], S, S, 1, nullptr,
           k_bksh != 0, v_bksh != 0, scale, blocks != 0};
  if ((k_bksh ? kd[3] : kd[2]) != sh.H || (v_bksh ? vd[2] : vd[3]) != sh.S ||
      kd[0] != sh.B || kd[1] != sh.K || vd[0] != sh.B || vd[1] != sh.K ||
      vis.dimensions()[0] != sh.B || vis.dimensions()[1] != sh.S)
    return ffi::Error::InvalidArgument("kvjax_decode_attention: inconsistent shapes");
  Run(pool, sh, q.typed_data(), kc.typed_data(), vc.typed_data(), vis.typed_data(),
      o->typed_data(), m->typed_data(), l->typed_data(), threads);
  return ffi::Error::Success();
}

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                    ffi::Buffer<ffi::F32> kc, ffi::Buffer<ffi::F32> vc,
                                    ffi::Buffer<ffi::PRED> vis, ffi::Buffer<ffi::S32> bt,
                                    ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                                    ffi::ResultBuffer<ffi::F32> l, int64_t k_bksh,
                                    int64_t v_bksh, float scale, int64_t threads,
                                    int64_t blocks) {
  auto qd = q.dimensions();
  auto kd = kc.dimensions();
  auto vd = vc.dimensions();
  auto bd = bt.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || vis.dimensions().size() != 2 ||
      bd.size() != 2)
    return ffi::Error::InvalidArgument(
        "kvjax_paged_decode_attention: q, k, v must be rank 4, visible and block_table rank 2");
  const int64_t P = k_bksh ? kd[2] : kd[3], M = bd[1], N = kd[0];
  Shape sh{qd[0], qd[1], qd[2], qd[3], v_bksh ? vd[3] : vd[2], M * P, P, M,
           bt.typed_data(), k_bksh != 0, v_bksh != 0, scale, blocks != 0};
  if ((k_bksh ? kd[3] : kd[2]) != sh.H || (v_bksh ? vd[2] : vd[3]) != P || vd[0] != N ||
      kd[1] != sh.K || vd[1] != sh.K || bd[0] != sh.B ||
      vis.dimensions()[0] != sh.B || vis.dimensions()[1] != sh.S)
    return ffi::Error::InvalidArgument("kvjax_paged_decode_attention: inconsistent shapes");
  for (int64_t i = 0; i < sh.B * M; ++i)
    if (sh.bt[i] < -1 || sh.bt[i] >= N)
      return ffi::Error::InvalidArgument(
          "kvjax_paged_decode_attention: a block-table entry outside [-1, num_pages)");
  Run(pool, sh, q.typed_data(), kc.typed_data(), vc.typed_data(), vis.typed_data(),
      o->typed_data(), m->typed_data(), l->typed_data(), threads);
  return ffi::Error::Success();
}

}  // namespace

#if defined(KVJAX_TRACE_PARTS)
// Copies up to max_rows records (5 doubles each: part, parts, 1 if a pool thread ran it,
// its start and end in seconds after the call's parts were scheduled) into out, drops
// them, and returns how many it copied.
extern "C" int64_t KvjaxTraceTake(double* out, int64_t max_rows) {
  std::lock_guard<std::mutex> lock(trace_mu);
  const int64_t n = std::min<int64_t>(max_rows, trace_rows.size() / 5);
  std::copy(trace_rows.begin(), trace_rows.begin() + 5 * n, out);
  trace_rows.erase(trace_rows.begin(), trace_rows.begin() + 5 * n);
  return n;
}
#endif

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
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("blocks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k_bksh")
                                  .Attr<int64_t>("v_bksh")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("blocks"));
