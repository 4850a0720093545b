// How the attention driver (attention_impl.h) spreads its work items over threads: items of
// (query tile, partition, KV head) in contiguous ranges of about equal estimated cost, one per
// thread, taken with stealing at the ends (work_ranges.h), and each thread's scratch. Which
// thread computes an item never changes its bits.
#pragma once

#include <ATen/Parallel.h>

#include "attention_common.h"
#include "work_ranges.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace sgl_cpu {
namespace {

constexpr int64_t PART = 512;  // positions per partition (one work item)

struct Item {
  int64_t seq, first, rows, part, head;  // tokens [first, first + rows) of sequence seq
};

// The positions [first, second) that item `it` attends to in its partition: from its first
// token's window start to its last token's position, within the partition.
inline std::pair<int64_t, int64_t> item_span(const Item& it,
                                             const std::vector<int64_t>& tok_pos,
                                             const std::vector<int64_t>& tok_lo) {
  return {std::max(tok_lo[it.first], it.part * PART),
          std::min(tok_pos[it.first + it.rows - 1] + 1, (it.part + 1) * PART)};
}

// Contiguous ranges of `items`, one per thread, of about equal estimated cost: bounds[i] ..
// bounds[i + 1]. An item's cost is the positions it spans times (TRANSPOSE_UNITS + its units),
// the K/V staging of a chunk costing about as much as three units' scores and P.V sums. (Equal
// item counts left one thread most of the work: a decode at 600 positions has items of 512 and
// 88 positions, a causal prefill tiles whose spans grow along the prompt.) The split changes
// which thread computes an item, never what it computes.
constexpr int64_t TRANSPOSE_UNITS = 3;

std::vector<int64_t> split_by_cost(const std::vector<Item>& items,
                                   const std::vector<int64_t>& tok_pos,
                                   const std::vector<int64_t>& tok_lo, int group) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> cum(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const auto [a, e] = item_span(items[i], tok_pos, tok_lo);
    cum[i + 1] = cum[i] + std::max<int64_t>(e - a, 1) * (TRANSPOSE_UNITS + items[i].rows * group);
  }
  std::vector<int64_t> bounds(threads + 1, n);
  bounds[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {  // the first item whose cost midpoint is past t/threads
    const int64_t target = cum[n] * t / threads;
    int64_t i = bounds[t - 1];
    while (i < n && cum[i] + (cum[i + 1] - cum[i]) / 2 < target) ++i;
    bounds[t] = i;
  }
  return bounds;
}

// One thread's scratch for work items of head_dim D: the prescaled queries (a chunk kernel
// that reads q in place needs none), a chunk's staged K and V rows and the chunk kernel's
// probabilities. Left uninitialized (every element is written before it is read:
// value-initialized buffers zeroed 64-190 KB per call and thread).
struct ItemScratch {
  std::unique_ptr<float[]> qs, kst, vst, prs;
  ItemScratch(int64_t D, bool prescaled)
      : qs(new float[prescaled ? TILE * MAX_GROUP * D : 1]), kst(new float[CHUNK * D]),
        vst(new float[CHUNK * D]), prs(new float[TILE * MAX_GROUP * CHUNK]) {}
};

// Calls work(item, scratch) once for every item: thread r takes the items of its range
// bounds[r] .. bounds[r + 1], then the next items left in the others' ranges, to the last one
// (run_ranges_with, work_ranges.h: an item's K/V comes from DRAM either way). Cost estimates
// miss by up to 2x (split_by_cost), and which thread runs an item never changes its bits.
template <typename Work>
void run_items(const std::vector<int64_t>& bounds, int64_t D, bool prescaled, Work&& work) {
  run_ranges_with(static_cast<int64_t>(bounds.size()) - 1,
                  [&](int64_t r) { return bounds[r + 1] - bounds[r]; }, 0,
                  [&] { return ItemScratch(D, prescaled); },
                  [&](ItemScratch& scratch, int64_t r, int64_t i) { work(bounds[r] + i, scratch); });
}

}  // namespace
}  // namespace sgl_cpu
