// Where the native grouped decode attention's time goes, per G: one thread, one KV head of
// S slots (keys [H, S], values [S, V], every slot visible), caches rotated over copies
// together twice the last-level cache (sysconf's L3 size; at least 6 copies) so every
// read comes from memory; best of 12 calls.
// Times the whole work item (FastItem) and each phase alone over the same spans: the
// scores (SpanScores: G = 1 and AVX2; GroupScores: G > 1 on AVX-512, with the heads'
// maxima), the online softmax on scores already in place (on AVX-512 with G > 1 given
// the maxima, as FastItem does), the values over a dense row's contiguous rows (without
// FastItem's prefetch of the next sub-block), and a plain read of the same bytes. On
// AVX-512, for G >= 2, also the per-block (flash-decoding) sweep, 'native_blocks'
// (BlockSweep in the kernel, at its passes, then at other pass lengths, prefetch
// distances and spans; docs/decisions/0045-grouped-decode-fused-blocks.md,
// docs/decisions/0052-grouped-decode-blocks-per-machine.md) against FastItem,
// paired in interleaved rounds (FusedAgainstFastItem; KVJAX_PAIRED_ROUNDS, default 41),
// and the same sweep over keys tiled [S / 64, H, 64] (a layout the cache does not have;
// docs/decisions/0053-sweep-passes-of-32-rows.md). KVJAX_PROFILE_H: H = V (default 64).
// Two threads sharing the memory: two copies at once, `(/tmp/prof ... > /tmp/b.txt &);
// /tmp/prof ...`.
//
//   g++ -O3 -march=native -std=c++17 -w -I$(python -c 'import jax.ffi; print(jax.ffi.include_dir())') \
//       -Ikvjax/native scripts/decode_attention_profile.cc -o /tmp/prof && /tmp/prof 32768 1 3 4 8 9
// (add -mno-avx512f for the AVX2 loops).
#include "../kvjax/native/decode_attention.cc"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

// FastItem's values over a dense row's contiguous run (copied: FastItem runs them
// inline), without its prefetch of the next sub-block.
static void SpanValuesContig(int64_t G, int64_t V, const float* scp, int64_t ld_sc,
                             const float* vb, int64_t n, float* o) {
  const int nv = ValueVectors(V);
  const int64_t gmax = HeadsPerGroup(G, ContigHeads(nv));
  std::vector<const float*> rows(n);
  for (int64_t j = 0; j < n; ++j) rows[j] = vb + j * V;
  for (int64_t j0 = 0; j0 < n; j0 += kSub) {
    const int64_t nj = std::min(kSub, n - j0);
    for (int64_t g0 = 0; g0 < G; g0 += gmax)
      for (int64_t c0 = 0; c0 < V; c0 += nv * VL)
        ValuesRowsAny<true>(nv, std::min(gmax, G - g0), scp + g0 * ld_sc + j0, ld_sc,
                            &rows[j0], nj, 0, c0, o + g0 * V, V);
  }
}

// A layout the kernel does not have, timed as a lead: keys tiled [S / 64, H, 64], a block
// of 64 slots' H key rows one contiguous 16 KiB stream (session 31's lead for G = 3-4),
// swept as BlockSweep does (GroupScoresBlock down a tile's rows, a tile 2 ahead
// prefetched, then BlockSoftmaxValues). kt: the tiles of n slots (n a multiple of 64).
template <int GB>
static void TiledSweepGB(const float* qs, int64_t H, const float* kt, const float* vp,
                         int64_t V, int64_t n, float* sc, int64_t ld_sc, float* m, float* l,
                         float* o) {
  constexpr int NJ = GroupNJ(GB) >= 4 ? 4 : 2;
  for (int64_t j = 0; j < n; j += 64) {
    for (int c0 = 0; c0 < 4; c0 += NJ)
      GroupScoresBlock<GB, NJ>(qs, H, 0, H, kt + j * H + c0 * VL, 64, sc + c0 * VL, ld_sc,
                               kt + (j + 2 * 64) * H + c0 * VL, nullptr, nullptr);
    BlockSoftmaxValues<GB>(sc, ld_sc, 64, vp + j * V, V, ValueVectors(V), m, l, o);
  }
}
static void TiledSweep(const float* qs, int64_t G, int64_t H, const float* kt,
                       const float* vp, int64_t V, int64_t n, float* sc, int64_t ld_sc,
                       float* m, float* l, float* o) {
  switch (G) {
#define KVJAX_TILED(N) \
  case N: if constexpr (N <= kGroupMax) \
    TiledSweepGB<N>(qs, H, kt, vp, V, n, sc, ld_sc, m, l, o); break;
    KVJAX_TILED(2) KVJAX_TILED(3) KVJAX_TILED(4) KVJAX_TILED(5) KVJAX_TILED(6)
    KVJAX_TILED(7) KVJAX_TILED(8) KVJAX_TILED(9)
#undef KVJAX_TILED
  }
}

// The per-block sweep (BlockSweep, 'native_blocks') against FastItem on the same head, in `rounds`
// interleaved rounds with a plain read of the same bytes, the caches rotated over
// `copies`: prints medians and the median of the paired ratios (fused / FastItem time:
// below 1, fused is faster), per (R, A, span) = passes of R key rows, the block A ahead
// prefetched, spans of that many slots. Compares the fused (o, m, l) with FastItem's on
// the first round: the largest |m - m'| + |l / l' - 1| or difference of o / l is printed.
static void FusedAgainstFastItem(const Shape& sh, const float* q, const float* kc,
                                 const float* vc, const bool* vis, int64_t copies,
                                 int rounds) {
  const int64_t G = sh.G, H = sh.H, V = sh.V, S = sh.S;
  const double bytes = double(S) * (H + V) * 4;
  auto med = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  std::vector<float> qs(G * H), m(G), l(G), o(G * V), m2(G), l2(G), o2(G * V);
  for (int64_t i = 0; i < G * H; ++i) qs[i] = q[i] * sh.scale;
  const int64_t span = std::min<int64_t>(kSpan, kScFloats / G) / VL * VL;
  std::vector<float> sc(G * (8192 + kScorePad));
  // the kernel's passes first, then GroupScoresGB's for up to 4 heads (session 33's sweep)
  const std::vector<std::array<int64_t, 3>> cfg = {
      {SweepRows(H), kPfAhead, span}, {8, 4, span}, {16, 2, span}, {32, 4, span},
      {H, 2, span}, {SweepRows(H), kPfAhead, 8192}};
  // the same keys tiled (TiledSweep), rotated over the same copies
  std::vector<float> kt(copies * H * S);
  for (int64_t c = 0; c < copies; ++c)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s)
        kt[c * H * S + s / 64 * 64 * H + h * 64 + s % 64] = kc[c * H * S + h * S + s];
  const int tiled = 2 + cfg.size(), nvar = tiled + (G >= 2);  // TiledSweep: G = 2-9
  std::vector<std::vector<double>> t(nvar);
  double err = 0.0;
  for (int r = 0; r < rounds + 2; ++r) {
    // the order rotates a place each round: a call right after the plain read ran up to
    // 8% slower than the same call elsewhere in the round
    for (int i = 0; i < nvar; ++i) {
      const int v = (i + r) % nvar;
      const int64_t c = (r * nvar + i) % copies;
      const float* kp = kc + c * H * S;
      const float* vp = vc + c * S * V;
      const auto t0 = std::chrono::steady_clock::now();
      if (v == 0) {
        FastItem(sh, q, kp, vp, vis, 0, 0, 0, S, m.data(), l.data(), o.data());
      } else if (v == 1) {  // a plain read of the same bytes
        vf x{}, y{};
        for (int64_t i = 0; i < H * S; i += 2 * VL) { x += ld(kp + i); y += ld(kp + i + VL); }
        for (int64_t i = 0; i < S * V; i += 2 * VL) { x += ld(vp + i); y += ld(vp + i + VL); }
        m2[0] = hsum(x + y);
      } else {
        std::fill(m2.begin(), m2.end(), kNegInf);
        std::fill(l2.begin(), l2.end(), 0.0f);
        std::fill(o2.begin(), o2.end(), 0.0f);
        if (v == tiled) {
          TiledSweep(qs.data(), G, H, kt.data() + c * H * S, vp, V, S, sc.data(),
                     64 + kScorePad, m2.data(), l2.data(), o2.data());
        } else {
          const auto [R, A, SP] = cfg[v - 2];
          for (int64_t sb = 0; sb < S; sb += SP)
            BlockSweep(qs.data(), G, H, kp + sb, S, vp + sb * V, V, SP, sc.data(),
                       SP + kScorePad, m2.data(), l2.data(), o2.data(), R, A);
        }
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r >= 2) t[v].push_back(s);
      if (r == 0 && v >= 2) {  // the same copy as FastItem's: recompute it there
        FastItem(sh, q, kp, vp, vis, 0, 0, 0, S, m.data(), l.data(), o.data());
        for (int64_t g = 0; g < G; ++g) {
          err = std::max<double>(err, std::abs(m2[g] - m[g]) + std::abs(l2[g] / l[g] - 1));
          for (int64_t h = 0; h < V; ++h)
            err = std::max<double>(err, std::abs(o2[g * V + h] / l2[g] - o[g * V + h] / l[g]));
        }
      }
    }
  }
  const double w = med(t[0]), rd = med(t[1]);
  std::printf("  paired, %d rounds: FastItem %.3f ms (%.0f%% of the read's %.1f GB/s); "
              "fused max error %.1e\n", rounds, w * 1e3, 100 * rd / w, bytes / rd / 1e9, err);
  for (int v = 2; v < nvar; ++v) {
    std::vector<double> ratio;
    for (size_t i = 0; i < t[v].size(); ++i) ratio.push_back(t[v][i] / t[0][i]);
    if (v == tiled)
      std::printf("  fused, keys tiled [S/64, H, 64]: ");
    else
      std::printf("  fused R=%2lld A=%lld span %4lld: ", (long long)cfg[v - 2][0],
                  (long long)cfg[v - 2][1], (long long)cfg[v - 2][2]);
    std::printf("%.3f ms (%.0f%% of the read), fused / FastItem %.3f\n", med(t[v]) * 1e3,
                100 * rd / med(t[v]), med(ratio));
  }
}

int main(int argc, char** argv) {
  const char* hv = std::getenv("KVJAX_PROFILE_H");  // head width H = V (default 64)
  const int64_t S = argc > 1 ? std::atoll(argv[1]) : 32768, H = hv ? std::atoll(hv) : 64,
                V = H;
  if (S <= 0 || S % 8192) {  // the sweep's spans of 4,096 and 8,192 slots tile the row
    std::fprintf(stderr, "error: S=%s; allowed: a positive multiple of 8192\n",
                 argc > 1 ? argv[1] : "");
    return 2;
  }
  if (H <= 0 || H % VL) {  // whole vectors of a key column and of a value row
    std::fprintf(stderr, "error: KVJAX_PROFILE_H=%s; allowed: a positive multiple of %d\n",
                 hv, VL);
    return 2;
  }
  for (int a = 2; a < argc; ++a)
    if (std::atoll(argv[a]) < 1 || std::atoll(argv[a]) > 9) {
      std::fprintf(stderr, "error: G=%s; allowed: 1 to 9\n", argv[a]);
      return 2;
    }
  // copies of 16 MiB at S = 32K: 33 on the Intel Xeon model 207's 260 MiB L3 (6 copies,
  // beyond a 32 MiB L3, fitted in it: its figures before session 34 were partly L3 reads)
  const int64_t l3 = std::max<long>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
  const int64_t copies = std::max<int64_t>(6, (2 * l3 + (H + V) * S * 4 - 1) / ((H + V) * S * 4));
  std::vector<float> kc(copies * H * S), vc(copies * S * V);
  for (size_t i = 0; i < kc.size(); ++i) kc[i] = float((i * 2654435761u) % 1000) / 1000 - 0.5f;
  for (size_t i = 0; i < vc.size(); ++i) vc[i] = float((i * 40503u) % 1000) / 1000 - 0.5f;
  std::unique_ptr<bool[]> vis(new bool[S]);
  std::fill(vis.get(), vis.get() + S, true);
  const double bytes = double(S) * (H + V) * 4;
  std::printf("S=%lld H=%lld V=%lld VL=%d; GB/s of cache read, one thread (ms a head)\n",
              (long long)S, (long long)H, (long long)V, VL);
  for (int a = 2; a < argc; ++a) {
    const int64_t G = std::atoll(argv[a]);
    std::vector<float> q(G * H);
    for (auto& x : q) x = 0.01f * float((&x - q.data()) % 7);
    std::vector<float> m(G), l(G), o(G * V);
    Shape sh{1, 1, G, H, V, S, S, 1, nullptr, false, true, 0.125f};
    auto time = [&](auto&& f) {
      double best = 1e30;
      for (int r = 0; r < copies + 12; ++r) {
        const int64_t c = r % copies;
        auto t0 = std::chrono::steady_clock::now();
        f(c);
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r >= copies) best = std::min(best, s);
      }
      return best;
    };
    const double whole = time([&](int64_t c) {
      FastItem(sh, q.data(), kc.data() + c * H * S, vc.data() + c * S * V, vis.get(), 0, 0, 0,
               S, m.data(), l.data(), o.data());
    });
    std::printf("G=%lld whole %6.1f GB/s (%.2f ms)\n", (long long)G, bytes / whole / 1e9,
                whole * 1e3);
    // The phases alone, over the same spans as FastItem (a dense row, all visible).
    const int64_t span = std::min<int64_t>(kSpan, kScFloats / G) / VL * VL, ld_sc = span + kScorePad;
    std::vector<float> qs(G * H), sc(G * ld_sc), mask(span + 2 * VL, 1.0f), bmax(G * VL);
    // FastItem's fused maxima: the grouped scores find them (AVX-512, G > 1), so the
    // softmax makes no pass for them
    const bool fused = GroupScoresApply(G);
    for (int64_t i = 0; i < G * H; ++i) qs[i] = q[i] * sh.scale;
    const double ts = time([&](int64_t c) {
      for (int64_t sb = 0; sb < S; sb += span)
        SpanScores(qs.data(), G, H, kc.data() + c * H * S + sb, S, span, sc.data(), ld_sc);
    });
    const double tg = time([&](int64_t c) {
      for (int64_t sb = 0; sb < S; sb += span)
        GroupScores(qs.data(), G, H, kc.data() + c * H * S + sb, S, span, sc.data(), ld_sc,
                    mask.data(), bmax.data());
    });
    const double tx = time([&](int64_t c) {
      for (int64_t sb = 0; sb < S; sb += span)
        SpanSoftmax(G, V, sc.data(), ld_sc, mask.data(), 0, span, span, m.data(), l.data(),
                    o.data(), fused ? bmax.data() : nullptr);
    });
    const double tv = time([&](int64_t c) {
      const float* vb = vc.data() + c * S * V;
      for (int64_t sb = 0; sb < S; sb += span)
        SpanValuesContig(G, V, sc.data(), ld_sc, vb + sb * V, span, o.data());
    });
    std::printf("  scores: SpanScores %5.1f GB/s of keys (%.2f ms), GroupScores %5.1f (%.2f ms); "
                "softmax %.2f ms; values %5.1f GB/s of values (%.2f ms)\n",
                bytes / 2 / ts / 1e9, ts * 1e3, bytes / 2 / tg / 1e9, tg * 1e3, tx * 1e3,
                bytes / 2 / tv / 1e9, tv * 1e3);
    // A plain read of the same bytes, as a roof for one thread.
    const double tr = time([&](int64_t c) {
      vf a{}, b{};
      const float* kp = kc.data() + c * H * S;
      const float* vp = vc.data() + c * S * V;
      for (int64_t i = 0; i < H * S; i += 2 * VL) { a += ld(kp + i); b += ld(kp + i + VL); }
      for (int64_t i = 0; i < S * V; i += 2 * VL) { a += ld(vp + i); b += ld(vp + i + VL); }
      m[0] = hsum(a + b);
    });
    std::printf("  read   %6.1f GB/s\n", bytes / tr / 1e9);
    if (kRegs == 32) {  // AVX2 keeps the phases (BlockSweepApplies)
      const char* env = std::getenv("KVJAX_PAIRED_ROUNDS");
      FusedAgainstFastItem(sh, q.data(), kc.data(), vc.data(), vis.get(), copies,
                           std::max(3, env ? std::atoi(env) : 41));
    }
  }
}
