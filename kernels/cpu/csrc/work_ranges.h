// Work split over threads in contiguous ranges, with stealing at the ends (header-only, no
// ISA-specific code: both kernel libraries use it).
//
// run_ranges(n, count, steal_above, item) calls item(r, i) once for every range r < n and item
// i < count(r): range r's items are taken in order from a shared counter by thread r (of n
// threads), and a thread done with its own range takes the next items of the
// others while more than steal_above of them are left. On a 2-core machine the HTTP process
// and the detokenizer run beside the model: a thread the OS preempts no longer holds the other
// at the barrier that ends the call for the rest of its range (libgomp's barrier waits were
// ~2.5% of a prefill), while the last few items stay with their owner (an item's data is in
// its owner's cache: a thief taking the last ones of a thread that was not held up made calls
// slower). Which thread runs an item must never change what it computes. Internal linkage, as
// prefetch.h: the two libraries are compiled for different instruction sets.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace sgl_cpu {
namespace {

// count(r): the items of range r; no allocation for up to 16 threads (a decode step makes
// ~120 calls of a few microseconds). With a thread state: each thread makes its own once with
// init() (scratch buffers, say) and item(state, r, i) gets it.
template <typename Count, typename Init, typename Item>
void run_ranges_with(int64_t n, Count&& count, int64_t steal_above, Init&& init, Item&& item) {
  struct alignas(64) Next {  // one cache line per range's counter
    std::atomic<int64_t> i{0};
  };
  constexpr int64_t SMALL = 16;
  Next small[SMALL];
  std::vector<Next> large(n > SMALL ? n : 0);
  Next* next = n > SMALL ? large.data() : small;
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    auto state = init();
    auto drain = [&](int64_t r, int64_t keep) {
      const int64_t items = count(r);
      while (next[r].i.load(std::memory_order_relaxed) < items - keep) {
        const int64_t i = next[r].i.fetch_add(1, std::memory_order_relaxed);
        if (i >= items) break;
        item(state, r, i);
      }
    };
    for (int64_t r = lo; r < hi; ++r) drain(r, 0);  // its own range first
    for (int64_t k = 1; k < n; ++k) drain((lo + k) % n, steal_above);  // then the others' rest
  });
}

template <typename Count, typename Item>
void run_ranges(int64_t n, Count&& count, int64_t steal_above, Item&& item) {
  run_ranges_with(n, count, steal_above, [] { return 0; },
                  [&](int, int64_t r, int64_t i) { item(r, i); });
}

}  // namespace
}  // namespace sgl_cpu
