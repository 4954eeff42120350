// Where the native grouped decode attention's time goes, per G: one thread, one KV head of
// S slots (keys [H, S], values [S, V], every slot visible), caches rotated over copies
// bigger than the last-level cache so every read comes from memory; best of 12 calls.
// Times the whole work item (FastItem) and each phase alone over the same spans: the
// scores (SpanScores: G = 1 and AVX2; GroupScores: G > 1 on AVX-512, with the heads'
// maxima), the online softmax on scores already in place (on AVX-512 with G > 1 given
// the maxima, as FastItem does), the values over a dense row's contiguous rows (without
// FastItem's prefetch of the next sub-block), and a plain read of the same bytes.
//
//   g++ -O3 -march=native -std=c++17 -w -I$(python -c 'import jax.ffi; print(jax.ffi.include_dir())') \
//       -Ikvjax/native scripts/decode_attention_profile.cc -o /tmp/prof && /tmp/prof 32768 1 3 4 8 9
// (add -mno-avx512f for the AVX2 loops).
#include "../kvjax/native/decode_attention.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>

// FastItem's values over a dense row's contiguous run (copied: FastItem runs them
// inline), without its prefetch of the next sub-block.
static void SpanValuesContig(int64_t G, int64_t V, const float* scp, int64_t ld_sc,
                             const float* vb, int64_t n, float* o) {
  const int nv = (V / VL) % 4 == 0 ? 4 : ((V / VL) % 2 == 0 ? 2 : 1);
  const auto groups = [G](int64_t cap) {
    return (G + (G + cap - 1) / cap - 1) / ((G + cap - 1) / cap);
  };
  const int64_t gmax = groups(std::max(1, std::min(6, AccFor(nv) / nv)));
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

int main(int argc, char** argv) {
  const int64_t S = argc > 1 ? std::atoll(argv[1]) : 32768, H = 64, V = 64;
  const int64_t copies = 6;  // 6 x 16 MiB at S = 32K: beyond a 32 MiB L3
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
      for (int r = 0; r < 3 * copies; ++r) {
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
  }
}
