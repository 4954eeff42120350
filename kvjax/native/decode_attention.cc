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

// One (b, k, [s0, s1)) work item: writes m[G], l[G], o[G*V].
static void Item(const Shape& sh, const float* q, const float* kc, const float* vc,
                 const bool* vis, int64_t b, int64_t k, int64_t s0, int64_t s1,
                 float* m, float* l, float* o) {
  const int64_t G = sh.G, H = sh.H, V = sh.V, S = sh.S;
  const float* qg = q + (b * sh.K + k) * G * H;
  const float* kb = kc + (b * sh.K + k) * S * H;
  const float* vb = vc + (b * sh.K + k) * S * V;
  const bool* visb = vis + b * S;
  std::vector<float> qs(G * H);
  for (int64_t i = 0; i < G * H; ++i) qs[i] = qg[i] * sh.scale;
  std::vector<float> sc(G * kBlock);
  for (int64_t g = 0; g < G; ++g) { m[g] = kNegInf; l[g] = 0.0f; }
  std::fill(o, o + G * V, 0.0f);
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
    // Values of the block.
    if (sh.v_bksh) {
      for (int64_t j = 0; j < n; ++j) {
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
          for (int64_t j = 0; j < n; ++j) acc += pr[j] * vr[j];
          o[g * V + h] += acc;
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
  kvjax_native::ParallelFor(pool, parts, [&](int64_t p) {
    for (int64_t it = items * p / parts; it < items * (p + 1) / parts; ++it) {
      const int64_t bk = it / chunks, c = it % chunks;
      const int64_t s0 = c * chunk, s1 = std::min(sh.S, s0 + chunk);
      Item(sh, qp, kp, vp, visp, bk / sh.K, bk % sh.K, s0, s1, &pm[it * G], &pl[it * G],
           &po[it * G * V]);
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
