// The native one-row weight loops alone, on two std::threads: how fast each SmolLM2 float32
// weight streams with main's loops and with the variants of decision 0046
// (docs/decisions/0046-one-row-walk-parts-and-prefetch.md), without XLA, its pool or the
// custom call. Includes kvjax/native/rows_matmul.cc to call its loops directly.
//
//   g++ -O3 -march=native -std=c++17 -w -I$(python -c 'import jax.ffi; print(jax.ffi.include_dir())') \
//       scripts/rows_walk_harness.cc -o /tmp/rows_walk_harness -lpthread
//   /tmp/rows_walk_harness [rounds]
//
// Per shape: 128 MiB of weight copies read in turn (from memory: above the 32 MiB L3), every
// variant once a round, interleaved, rounds after one warm-up; prints the median GB/s of
// weight read and the quartiles' GB/s. One row (M = 1), split in two K halves ('kn') or two
// output-row halves ('nk'), the second half on a worker that spins between products, except
// 'sleep' (a worker that waits on a condition variable, as a pool thread sleeps) and
// 'one_thread'. Variants: 'cur' main's loop (WalkRowsKN / RowDotsNK), 'kr4' four weight rows
// a pass (WalkPass<1, 4>), 'pf4k' the head's row dots with a prefetch 4 KiB ahead.
// Run it only on an otherwise idle machine (/work/runs/quiet.sh): a spinning worker that
// shares its core with another busy process streams at a small fraction of the rate.
#include "../kvjax/native/rows_matmul.cc"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct SpinWorker {
  std::atomic<int> gen{0}, done{0};
  std::atomic<bool> stop{false};
  std::function<void()> job;
  std::thread t;
  SpinWorker() {
    t = std::thread([this] {
      for (int seen = 0; !stop.load();) {
        const int g = gen.load(std::memory_order_acquire);
        if (g == seen) { _mm_pause(); continue; }
        seen = g;
        job();
        done.store(g, std::memory_order_release);
      }
    });
  }
  ~SpinWorker() { stop = true; t.join(); }
  void Run2(const std::function<void()>& a, std::function<void()> b) {
    job = std::move(b);
    const int g = gen.load() + 1;
    gen.store(g, std::memory_order_release);
    a();
    while (done.load(std::memory_order_acquire) != g) _mm_pause();
  }
};

struct SleepWorker {
  std::mutex mu;
  std::condition_variable cv, cvd;
  int gen = 0, done = 0;
  bool stop = false;
  std::function<void()> job;
  std::thread t;
  SleepWorker() {
    t = std::thread([this] {
      for (int seen = 0;;) {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return stop || gen != seen; });
        if (stop) return;
        seen = gen;
        l.unlock();
        job();
        l.lock();
        done = seen;
        cvd.notify_one();
      }
    });
  }
  ~SleepWorker() {
    { std::lock_guard<std::mutex> l(mu); stop = true; }
    cv.notify_one();
    t.join();
  }
  void Run2(const std::function<void()>& a, std::function<void()> b) {
    int g;
    { std::lock_guard<std::mutex> l(mu); job = std::move(b); g = ++gen; }
    cv.notify_one();
    a();
    std::unique_lock<std::mutex> l(mu);
    cvd.wait(l, [&] { return done == g; });
  }
};

void WalkCur(const float* x, int64_t K, const float* w, int64_t N, int64_t k0, int64_t k1,
             float* y) {
  WalkRowsKN<1>(x, K, w, N, k0, k1, y);
}

void WalkKR4(const float* x, int64_t K, const float* w, int64_t N, int64_t k0, int64_t k1,
             float* y) {
  std::fill(y, y + N, 0.0f);
  const int64_t k = WalkPass<1, 4>(x, K, w, N, k0, k1, y, N);
  WalkPass<1, 1>(x, K, w, N, k, k1, y, N);
}

void DotsCur(const float* x, int64_t K, const float* w, int64_t N, int64_t c0, int64_t c1,
             float* y) {
  RowDotsNK<1>(x, K, w, N, c0, c1, y);
}

// RowDotsNK<1> with the stream prefetched PF floats ahead into L2 (K % 64 == 0).
template <int64_t PF>
void DotsPrefetch(const float* x, int64_t K, const float* w, int64_t N, int64_t c0,
                  int64_t c1, float* y) {
  for (int64_t n = c0; n < c1; ++n) {
    const float* wr = w + n * K;
    vf a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
    for (int64_t k = 0; k < K; k += 4 * VW) {
      for (int j = 0; j < 4 * VW; j += 16) __builtin_prefetch(wr + k + j + PF, 0, 2);
      a0 = fma(load(x + k), load(wr + k), a0);
      a1 = fma(load(x + k + VW), load(wr + k + VW), a1);
      a2 = fma(load(x + k + 2 * VW), load(wr + k + 2 * VW), a2);
      a3 = fma(load(x + k + 3 * VW), load(wr + k + 3 * VW), a3);
    }
    y[n] = hsum((a0 + a1) + (a2 + a3));
  }
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

typedef void (*Part)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*);

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 15;
  if (rounds < 1) {
    std::fprintf(stderr, "rounds=%s; allowed: an integer >= 1\n", argv[1]);
    return 2;
  }
  SpinWorker spin;
  SleepWorker sleep;
  std::vector<float> x(2048, 0.01f);
  struct Shape { int64_t K, N; bool nk; const char* name; };
  const Shape shapes[] = {{576, 960, false, "q/k/v"}, {576, 576, false, "o"},
                          {576, 3072, false, "gate/up"}, {1536, 576, false, "down"},
                          {576, 49152, true, "head"}};
  for (const Shape& s : shapes) {
    const int64_t elems = s.K * s.N;
    const int64_t copies = std::max<int64_t>(2, (128ll << 20) / (4 * elems));
    std::vector<float*> ws(copies);
    for (auto*& p : ws) {
      p = static_cast<float*>(std::aligned_alloc(64, elems * 4));
      for (int64_t i = 0; i < elems; ++i) p[i] = (i % 7) * 0.001f;
    }
    std::vector<float> y(s.N), yp(s.N);
    std::vector<std::pair<std::string, std::function<void(const float*)>>> vs;
    // two halves: K halves into y and yp, added ('kn'), or output-row halves ('nk')
    auto halves = [&](const char* name, Part f, bool sleeping) {
      vs.push_back({name, [&, f, sleeping](const float* w) {
        const int64_t h = (s.nk ? s.N : s.K) / 2, end = s.nk ? s.N : s.K;
        float* second = s.nk ? y.data() : yp.data();
        auto a = [&] { f(x.data(), s.K, w, s.N, 0, h, y.data()); };
        auto b = [&] { f(x.data(), s.K, w, s.N, h, end, second); };
        if (sleeping) sleep.Run2(a, b); else spin.Run2(a, b);
        if (!s.nk) for (int64_t i = 0; i < s.N; ++i) y[i] += yp[i];
      }});
    };
    if (!s.nk) {
      halves("cur", WalkCur, false);
      halves("kr4", WalkKR4, false);
      halves("sleep", WalkCur, true);
      vs.push_back({"one_thread", [&](const float* w) {
        WalkCur(x.data(), s.K, w, s.N, 0, s.K, y.data());
      }});
    } else {
      halves("cur", DotsCur, false);
      halves("pf4k", DotsPrefetch<1024>, false);
    }
    std::vector<std::vector<double>> t(vs.size());
    for (int r = 0; r <= rounds; ++r)
      for (size_t v = 0; v < vs.size(); ++v) {
        const double t0 = Now();
        for (const float* w : ws) vs[v].second(w);
        if (r) t[v].push_back(Now() - t0);
      }
    const double bytes = 4.0 * elems * copies;
    for (size_t v = 0; v < vs.size(); ++v) {
      std::sort(t[v].begin(), t[v].end());
      const size_t n = t[v].size();
      std::printf("%-8s [%lld, %lld]%s %-10s %6.2f GB/s median (quartiles %5.2f - %5.2f)\n",
                  s.name, static_cast<long long>(s.nk ? s.N : s.K),
                  static_cast<long long>(s.nk ? s.K : s.N), s.nk ? " nk" : "",
                  vs[v].first.c_str(), bytes / t[v][n / 2] / 1e9, bytes / t[v][n * 3 / 4] / 1e9,
                  bytes / t[v][n / 4] / 1e9);
    }
    std::fflush(stdout);
    for (float* p : ws) std::free(p);
  }
  return 0;
}
