// Work split over XLA's own intra-op thread pool (XLA FFI ThreadPool context), shared by
// the native CPU kernels.
//
// Why not OpenMP: an OpenMP team spins after each parallel region, waiting for the next
// one, on the same cores XLA's Eigen threads need for the ops around the custom call
// (a 2-core CPU has no spare core); XLA's pool is the one the rest of the step uses.
// A pool of kvjax's own whose workers poll between the kernels' calls did not make a
// step faster, and slowed XLA's products beside it (docs/decisions/0049).
//
// ParallelFor(pool, parts, f) runs f(p) for p in [0, parts): the caller and up to
// parts - 1 scheduled pool tasks claim parts from a shared counter, so the caller never
// waits for a part nobody has started (no deadlock when the pool is busy or the caller
// runs on its only thread); a task that starts after all parts are claimed returns.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace kvjax_native {

template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t parts, F f) {
  if (parts <= 1) {
    if (parts == 1) f(int64_t{0});
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  auto work = [st, f, parts] {
    for (int64_t p; (p = st->next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      f(p);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t p = 1; p < parts; ++p) pool.Schedule(decltype(work)(work));
  work();
  int spins = 0;
  while (st->done.load(std::memory_order_acquire) < parts) {
    if (++spins > 1000) std::this_thread::yield();
  }
}

}  // namespace kvjax_native
