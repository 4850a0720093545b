// How fast a decode step's K/V rows stream from DRAM in the orders an attention kernel can read
// them, and whether a weight stream overlaps with them: the memory side of the one-stream
// 4,096-token row of issue [2/8], without the attention arithmetic. 30 layers of SmolLM2's
// K and V pools ([4,097 slots, 3 KV heads, 64] bfloat16, slots in order) and 2.2 MB of weights a
// layer (its int4 linears), all read with 512-bit loads summed into a register. A standalone
// program, not part of the server:
//
//   g++ -O3 -march=native -fopenmp benchmarks/kv_stream.cpp -o /tmp/kv_stream
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=true /tmp/kv_stream [head-major]
//
// head-major: the pools as server/cache/kv_pool.py lays them out on a CPU since 2026-11-28
// ([3 KV heads, 4,097 slots, 64]: a head's rows of consecutive slots are contiguous); the
// whole-row orders need slot-major pools and are left out.
//
// Orders (each thread a contiguous range of the work, as the kernel's run_items):
//   plain read          each thread half of each pool, in address order (torch.sum's)
//   per head, prefetch  the kernel's: items (512-position partition, KV head), each reading
//                       2 of every 6 lines of a row, rows prefetched 32 positions ahead (L2)
//   per head            the same without the software prefetch
//   whole rows          items of a partition's every head: all 6 lines of a row, in order
//   touch, heads inner  a chunk's 32 rows touched whole in order, then read head by head
//   prefetch, heads inner  the chunk's rows software-prefetched instead of touched
//   weights alone       the layer's weights, each thread half in order
//   K/V then weights    per head, prefetch; then the layer's weights read in order
//   weights interleaved per head, prefetch, with ~2.8 weight lines loaded per position
//   chunk order         the decode chunk kernel's (csrc_vnni/attention_bf16.cpp): per 32-position
//                       chunk, each 16-row half's K rows prefetched 32 positions ahead, then
//                       read a line of every row at a time; then the chunk's V rows in pairs
//   chunk order, no prefetch   the same without the software prefetch
//   weights then chunk order   the layer's weights, then its K/V in chunk order (a decode
//                       step's order: the linears, then the attention)
//   K/V prefetched under weights  the same, with each thread's share of the K/V prefetched
//                       into L2 while its weight half streams (a line or two a weight line)
//   chunk blocks        (head-major) per chunk, its K block then its V block (4 KB each) in
//                       address order, the next chunk's prefetched first: the reads of a pool
//                       that kept K in pair columns and V in position pairs (no transposes)
// 2026-11-28, 2-core AMD EPYC Zen 4 (family 19h), slot-major, GB/s in a slow / a fast minute:
// plain 29-35 / 47-52; per head with prefetch 22-24 / 32-33, without 21-22 / 26-27; whole rows
// 32-39 / 54-66; touch + heads inner 29-33 / 40-44; prefetch + heads inner 25-28 / 34-37; ms a
// layer for K/V then weights 0.169-0.188 / 0.125-0.134 against weights interleaved
// 0.167-0.193 / 0.111-0.113. The hardware prefetchers follow ascending demand loads, which
// software prefetches do not train. In the kernel neither lever carried over (docs/kernels.md).
// 2026-11-29, the same machine, head-major, six rounds (GB/s; one slow round aside, plain read
// 34-38): per head 36-40 with or without the prefetch; chunk order 32-33 with or without it
// (0.83-0.90 of per head in the same round). In the kernel itself, where each chunk's arithmetic
// sits between its loads, the software prefetch is what keeps the stream going: without it a
// 1 x (4096 + 1) decode from DRAM took 0.18 ms a layer against 0.097 (docs/kernels.md). A
// layer's weights then its K/V in chunk order 0.163-0.173 ms a layer (31-33 GB/s, the plain
// read 29-36 in the same runs); with the K/V prefetched under the weights 0.190-0.197: fetching
// the next attention's K/V while the linears stream does not pay on this class.
// 2026-11-29 05:40, the same machine, three rounds (GB/s): chunk blocks 41.9 / 43.1 / 42.9
// against chunk order 37.5 / 41.9 / 40.7 (+3-12%), per head 39.1 / 55.5 / 55.4 without the
// prefetch, plain read 30.9 / 42.7 / 43.1: a pool laid out for transpose-free decode chunks
// would stream its K/V little faster; what it would save is the transposes' arithmetic.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int LAYERS = 30, HEADS = 3, D = 64, N = 4096, PART = 512, CHUNK = 32, AHEAD = 32;
constexpr int64_t ROW = HEADS * D * 2, HEAD_BYTES = D * 2;  // bytes of a row, of a head's part
constexpr int64_t WEIGHT_BYTES = 2200 * 1024;
char *k_pool[LAYERS], *v_pool[LAYERS], *weights[LAYERS];
volatile float sink;
bool head_major = false;

// Head h's part of slot `slot`'s row in a pool, slot-major [N + 1, HEADS, D] or head-major
// [HEADS, N + 1, D].
inline const char* head_row(const char* pool, int64_t slot, int h) {
  return head_major ? pool + (h * static_cast<int64_t>(N + 1) + slot) * HEAD_BYTES
                    : pool + slot * ROW + h * HEAD_BYTES;
}

enum Order {
  PLAIN, PER_HEAD_PF, PER_HEAD, WHOLE_ROWS, TOUCH_INNER, PF_INNER, WEIGHTS, THEN_W, WITH_W,
  CHUNK_PF, CHUNK_NO_PF, W_THEN_CHUNK, W_PF_KV, BLOCKS, ORDERS
};
const char* NAMES[ORDERS] = {"plain read", "per head, prefetch", "per head", "whole rows",
                             "touch, heads inner", "prefetch, heads inner", "weights alone",
                             "K/V then weights", "weights interleaved", "chunk order",
                             "chunk order, no prefetch", "weights then chunk order",
                             "K/V prefetched under weights", "chunk blocks"};

inline __m512 load(const char* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }

// Sum [p, p + bytes) in address order into acc.
inline void read_span(const char* p, int64_t bytes, __m512& acc) {
  for (int64_t o = 0; o < bytes; o += 64) acc = _mm512_add_ps(acc, load(p + o));
}

// The kernel's order on thread t of nt: its contiguous range of (partition, head) items, each
// row's head part read and (pf) the row AHEAD positions on prefetched into L2; with_w: after
// each position, the next weight lines of the thread's half, ~WEIGHT_BYTES / K/V bytes of them.
void per_head(const char* K, const char* V, const char* W, int t, int nt, bool pf, bool with_w,
              __m512& acc) {
  const int items = N / PART * HEADS, per = items / nt;
  const int64_t w_half = WEIGHT_BYTES / nt, positions = static_cast<int64_t>(per) * PART;
  const char* w = W + t * w_half;
  int64_t w_done = 0, visited = 0;
  for (int i = t * per; i < (t + 1) * per; ++i) {
    const int part = i / HEADS, h = i % HEADS, end = (part + 1) * PART;
    for (int p = part * PART; p < end; ++p, ++visited) {
      if (pf && p + AHEAD < end)
        for (const char* base : {K, V}) {
          const char* a = head_row(base, p + 1 + AHEAD, h);
          _mm_prefetch(a, _MM_HINT_T1);
          _mm_prefetch(a + 64, _MM_HINT_T1);
        }
      read_span(head_row(K, p + 1, h), HEAD_BYTES, acc);
      read_span(head_row(V, p + 1, h), HEAD_BYTES, acc);
      if (with_w) {
        const int64_t due = w_half * (visited + 1) / positions / 64 * 64;
        read_span(w + w_done, due - w_done, acc);
        w_done = due;
      }
    }
  }
  if (with_w) read_span(w + w_done, w_half - w_done, acc);
}

// Rows [j0, j0 + n) of head h of a pool (positions; slot = position + 1) read a 64-byte line
// of every row at a time, as the chunk kernel's in-register transposes and V pairs load them,
// after (pf) prefetching into L2 the rows AHEAD positions on that lie before `end`.
void rows_by_line(const char* pool, int j0, int n, int end, int h, bool pf, __m512& acc) {
  for (int j = j0; pf && j < j0 + n; ++j)
    if (j + AHEAD < end)
      for (int line = 0; line < 2; ++line)
        _mm_prefetch(head_row(pool, j + 1 + AHEAD, h) + 64 * line, _MM_HINT_T1);
  for (int line = 0; line < 2; ++line)
    for (int j = j0; j < j0 + n; ++j) acc = _mm512_add_ps(acc, load(head_row(pool, j + 1, h) + 64 * line));
}

// The decode chunk kernel's order on thread t: per item and chunk, each 16-row half's K rows,
// then the chunk's V rows in pairs (rows_by_line).
void chunk_order(const char* K, const char* V, int t, int nt, bool pf, __m512& acc) {
  const int items = N / PART * HEADS, per = items / nt;
  for (int i = t * per; i < (t + 1) * per; ++i) {
    const int part = i / HEADS, h = i % HEADS, end = (part + 1) * PART;
    for (int c = part * PART; c < end; c += CHUNK) {
      for (int j0 = c; j0 < c + CHUNK; j0 += 16) rows_by_line(K, j0, 16, end, h, pf, acc);
      for (int j = c; j < c + CHUNK; j += 2) rows_by_line(V, j, 2, end, h, pf, acc);
    }
  }
}

// A pool whose chunk of 32 positions is one block a head (K in pair columns, V in position
// pairs: the layout a decode chunk could read without transposes) on thread t: per item and
// chunk, the next chunk's K and V blocks prefetched into L2, then this chunk's K block and V
// block read in address order (head-major pools: a chunk's rows are those bytes).
void chunk_blocks(const char* K, const char* V, int t, int nt, __m512& acc) {
  const int items = N / PART * HEADS, per = items / nt;
  constexpr int64_t BLOCK = CHUNK * HEAD_BYTES;
  for (int i = t * per; i < (t + 1) * per; ++i) {
    const int part = i / HEADS, h = i % HEADS, end = (part + 1) * PART;
    for (int c = part * PART; c < end; c += CHUNK) {
      for (const char* pool : {K, V}) {
        const char* next = head_row(pool, c + 1 + AHEAD, h);
        for (int64_t o = 0; c + AHEAD < end && o < BLOCK; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
        read_span(head_row(pool, c + 1, h), BLOCK, acc);
      }
    }
  }
}

// Thread t's weight half, with (pf) its chunk-order share of the K/V rows prefetched into L2
// spread over the weight lines (a K/V line or two after each weight line), as a linear layer's
// loop could fetch the next attention's K/V while the weights stream.
void weights_pf_kv(const char* W, const char* K, const char* V, int t, int nt, bool pf,
                   __m512& acc) {
  const int per = N / PART * HEADS / nt;
  const int64_t kv_lines = static_cast<int64_t>(per) * PART * 4, w_lines = WEIGHT_BYTES / nt / 64;
  const char* w = W + t * (WEIGHT_BYTES / nt);
  int64_t next = 0;
  for (int64_t i = 0; i < w_lines; ++i) {
    acc = _mm512_add_ps(acc, load(w + 64 * i));
    for (const int64_t due = pf ? kv_lines * (i + 1) / w_lines : 0; next < due; ++next) {
      const int64_t r = next / 4, item = t * per + r / PART;  // 4 lines a position: K, V
      const int pos = static_cast<int>(item / HEADS * PART + r % PART), h = item % HEADS;
      _mm_prefetch(head_row(next % 4 < 2 ? K : V, pos + 1, h) + 64 * (next % 2), _MM_HINT_T1);
    }
  }
}

// Items of a partition's every head on thread t (slot-major pools only): per chunk, whole rows
// in order (WHOLE_ROWS), or the chunk's rows touched whole (TOUCH_INNER) or prefetched
// (PF_INNER) and then read head by head, K then V.
void all_heads(const char* K, const char* V, int t, int nt, Order order, __m512& acc) {
  const int per = N / PART / nt;
  __m512 touched = _mm512_setzero_ps();
  for (int c = t * per * PART; c < (t + 1) * per * PART; c += CHUNK) {
    const char *kc = K + (c + 1) * ROW, *vc = V + (c + 1) * ROW;  // slot c + 1: position c
    if (order == WHOLE_ROWS) {
      read_span(kc, CHUNK * ROW, acc);
      read_span(vc, CHUNK * ROW, acc);
      continue;
    }
    for (const char* base : {kc, vc})
      for (int64_t o = 0; o < CHUNK * ROW; o += 64) {
        if (order == TOUCH_INNER) touched = _mm512_add_ps(touched, load(base + o));
        else _mm_prefetch(base + o, _MM_HINT_T1);
      }
    for (int h = 0; h < HEADS; ++h)
      for (const char* base : {kc, vc})
        for (int j = 0; j < CHUNK; ++j) read_span(base + j * ROW + h * HEAD_BYTES, HEAD_BYTES, acc);
  }
  acc = _mm512_add_ps(acc, touched);
}

float run(Order order, int l) {
  const char *K = k_pool[l], *V = v_pool[l];  // slots 1 .. N hold positions 0 .. N - 1
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    __m512 acc = _mm512_setzero_ps();
    switch (order) {
      case PLAIN:
        for (const char* base : {K, V}) read_span(base + ROW + t * (N * ROW / nt), N * ROW / nt, acc);
        break;
      case WEIGHTS:
        read_span(weights[l] + t * (WEIGHT_BYTES / nt), WEIGHT_BYTES / nt, acc);
        break;
      case BLOCKS:
        chunk_blocks(K, V, t, nt, acc);
        break;
      case CHUNK_PF: case CHUNK_NO_PF:
        chunk_order(K, V, t, nt, order == CHUNK_PF, acc);
        break;
      case W_THEN_CHUNK: case W_PF_KV:
        weights_pf_kv(weights[l], K, V, t, nt, order == W_PF_KV, acc);
        chunk_order(K, V, t, nt, true, acc);
        break;
      case PER_HEAD_PF: case PER_HEAD: case THEN_W: case WITH_W:
        per_head(K, V, weights[l], t, nt, order != PER_HEAD, order == WITH_W, acc);
        if (order == THEN_W)
          read_span(weights[l] + t * (WEIGHT_BYTES / nt), WEIGHT_BYTES / nt, acc);
        break;
      default:
        all_heads(K, V, t, nt, order, acc);
    }
    total += _mm512_reduce_add_ps(acc);
  }
  return total;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  head_major = argc > 1 && std::strcmp(argv[1], "head-major") == 0;
  const int64_t pool_bytes = static_cast<int64_t>(N + 1) * ROW;
  for (int l = 0; l < LAYERS; ++l) {  // written once, so every page is resident
    k_pool[l] = static_cast<char*>(std::aligned_alloc(64, pool_bytes));
    v_pool[l] = static_cast<char*>(std::aligned_alloc(64, pool_bytes));
    weights[l] = static_cast<char*>(std::aligned_alloc(64, WEIGHT_BYTES));
    std::memset(k_pool[l], 1, pool_bytes);
    std::memset(v_pool[l], 1, pool_bytes);
    std::memset(weights[l], 1, WEIGHT_BYTES);
  }
  std::printf("%d layers x 2 x %d positions x %lld B rows, %s (+ %.1f MB weights a layer where "
              "read)\n", LAYERS, N, static_cast<long long>(ROW),
              head_major ? "head-major" : "slot-major", WEIGHT_BYTES / 1e6);
  for (int round = 0; round < 3; ++round) {  // rounds: the machine's bandwidth drifts
    for (int o = 0; o < ORDERS; ++o) {
      const Order order = static_cast<Order>(o);
      if (head_major && (order == WHOLE_ROWS || order == TOUCH_INNER || order == PF_INNER)) continue;
      if (!head_major && order == BLOCKS) continue;
      double best = 1e9;
      for (int rep = 0; rep < 5; ++rep) {
        const double a = now();
        float s = 0;
        for (int l = 0; l < LAYERS; ++l) s += run(order, l);
        sink = s;
        best = std::min(best, (now() - a) / LAYERS);
      }
      const bool w = order == WEIGHTS || order == THEN_W || order == WITH_W ||
                     order == W_THEN_CHUNK || order == W_PF_KV;
      const double bytes = (order == WEIGHTS ? 0.0 : 2.0 * N * ROW) + (w ? WEIGHT_BYTES : 0);
      std::printf("%-22s %.3f ms a layer  %5.1f GB/s\n", NAMES[o], best * 1e3, bytes / best / 1e9);
    }
    std::printf("\n");
  }
}
