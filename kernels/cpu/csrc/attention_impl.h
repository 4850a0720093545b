// The driver of attention over the token-granular KV pool, reading K/V rows in place through
// each sequence's slot indices (no gather copy, no mask tensor), for decode and extend passes
// alike (a decode is an extend of one token): attention_forward<Chunk>, instantiated with the
// AVX2 chunk kernel as sgl_cpu::attention (attention.cpp) and with the AVX-512 one as
// sgl_cpu_vnni::attention (csrc_vnni/attention512.cpp).
//
// Query token i of sequence b sits at position p = prefix_lens[b] + i and attends to positions
// [lo, p], lo = max(0, p - window + 1) with a sliding window, else 0 (the contract of
// kernels.base.AttentionBackend.attend). GQA: the Hq / Hkv query heads of one KV head are
// computed together, so each K/V row is read once for the group.
//
// Fixed partitions (flash-decoding, Dao et al. 2023): positions are cut into partitions of
// PART positions counted from 0; each (tile of up to TILE query tokens of one sequence, KV
// head, partition) is one work item running an online softmax (Milakov & Gimelshein 2018) over
// chunks of CHUNK positions, whose K/V rows are read once for the tile (in place, or staged as
// float32 where many units share them) and passed to the chunk kernel, which computes the
// scores and P.V sums of several (token, head) units per K/V row read; each token's partials
// are merged in partition order. A long single sequence thus spreads over every core, and
// because the cuts depend only on positions, a token's output is bitwise the same whatever
// else is in the batch, however many threads run, and whether it is computed in a decode step
// or in an extend pass.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "attention_common.h"
#include "attention_merge.h"
#include "attention_split.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace sgl_cpu {
namespace {

constexpr int64_t AHEAD = CHUNK;  // positions between a K/V row's prefetch and its load (one chunk:
// from DRAM, a 4,096-token decode on Zen 5 ran 12-14% faster than with 2 chunks, 8-16 positions
// were too late and 128+ too early; extends unchanged. On Zen 4, prefetching into L2
// (prefetch_into_l2), 32 was also best: 16-24 and 48-96 slower)

struct Row {          // one query token of a tile
  int64_t lo, pos;    // it attends to positions [lo, pos]
  float* out;         // its partial for this partition: per query head m, l, acc[D]
  int64_t token;      // its index in the batch
};

// A token's only partial (m, l, acc [D]) as its output o [D], acc / l rounded to T, where l > 0
// and m is finite (else the merge, which handles empty rows, writes the output).
template <typename T>
inline void write_single_partial(const float* part, T* o, int64_t D) {
  if (!(part[1] > 0.0f && std::isfinite(part[0]))) return;
  // acc * (1 / l), as the merge of one partition gives it (ca = 0, cb = exp(0) = 1)
  const __m256 vi = _mm256_set1_ps(1.0f / part[1]), zero = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8)
    store8(o + d, _mm256_mul_ps(_mm256_add_ps(zero, load8(part + 2 + d)), vi));
}

// The chunk at c0's K/V row pointers (nullptr outside [a, e)) and the rows AHEAD positions on
// to prefetch (nullptr past e), read through the sequence's slot indices.
template <typename KV>
inline void chunk_rows_at(ChunkRows<KV>& rows, int64_t c0, int64_t a, int64_t e, const KV* kbuf,
                          const KV* vbuf, int64_t row_stride, const int64_t* slots) {
  for (int64_t j = 0; j < CHUNK; ++j) {
    const int64_t p = c0 + j;
    const bool in = p >= a && p < e, pf = in && p + AHEAD < e;
    rows.k[j] = in ? kbuf + slots[p] * row_stride : nullptr;
    rows.v[j] = in ? vbuf + slots[p] * row_stride : nullptr;
    rows.ahead[j][0] = pf ? reinterpret_cast<const char*>(kbuf + slots[p + AHEAD] * row_stride) : nullptr;
    rows.ahead[j][1] = pf ? reinterpret_cast<const char*>(vbuf + slots[p + AHEAD] * row_stride) : nullptr;
  }
}

// Online softmax (Milakov & Gimelshein 2018) of the `rows` query tokens' `group` heads (q:
// [rows * group] pointers to each unit's query, as the chunk kernel takes it) over the positions [a, e) of one KV head of one
// sequence. Positions are visited in chunks of CHUNK aligned to absolute multiples of CHUNK;
// a row skips the chunks that hold none of its positions and masks the others' lanes, so each
// row's arithmetic is the same whatever tile or batch it is computed in. K/V rows are read in
// place, except that bfloat16 rows shared by more than 4 units (extend tiles) are staged as
// float32 once per chunk; the two give bitwise the same result (conversion is exact).
template <typename Chunk, int NV, typename KV>
void attend_chunks(const float* const* q, const Row* rows, int nrows, int group, const KV* kbuf,
                   const KV* vbuf, int64_t row_stride, const int64_t* slots, int64_t a,
                   int64_t e, float scale, float softcap, float* kst, float* vst, float* prs,
                   bool l2) {
  constexpr int64_t nv = NV, D = 8 * NV;
  for (int r = 0; r < nrows; ++r)
    for (int g = 0; g < group; ++g) {
      float* o = rows[r].out + g * (D + 2);
      o[0] = NEG_INF;
      o[1] = 0.0f;
      std::fill(o + 2, o + 2 + D, 0.0f);
    }
  // Read in place where rows are bfloat16 and shared by at most 4 units (decode): converting
  // in registers beats staging. Staged otherwise: bfloat16 rows shared by more units are
  // converted once, and float32 rows staged (a plain copy) measured faster from DRAM than
  // read in place (the tight copy loop keeps more misses in flight).
  const bool stage = Chunk::kStage && (std::is_same_v<KV, float> || nrows * group > 4);
  ChunkRows<KV> direct;
  ChunkRows<float> staged;
  direct.ahead_bytes = D * static_cast<int64_t>(sizeof(KV));
  staged.ahead_bytes = 0;
  direct.ahead_l2 = staged.ahead_l2 = l2;
  const float* qs[TILE * MAX_GROUP];
  float* outs[TILE * MAX_GROUP];
  const float* valids[TILE * MAX_GROUP];
  alignas(64) float valid[TILE][CHUNK];
  // chunks within [all_lo, all_hi) hold positions of every row and none to mask: their units
  // (every row's, unmasked) are listed once and reused
  int64_t all_lo = a, all_hi = e;
  for (int r = 0; r < nrows; ++r) {
    all_lo = std::max(all_lo, rows[r].lo);
    all_hi = std::min(all_hi, rows[r].pos + 1);
  }
  int all_units = 0;  // the length of that list while qs, outs and valids hold it, else 0
  for (int64_t c0 = (a / CHUNK) * CHUNK; c0 < e; c0 += CHUNK) {
    chunk_rows_at(direct, c0, a, e, kbuf, vbuf, row_stride, slots);
    for (int64_t j = 0; j < CHUNK && stage; ++j) {
      const KV *k = direct.k[j], *v = direct.v[j];
      staged.ahead[j][0] = staged.ahead[j][1] = nullptr;
      prefetch_row(direct.ahead[j][0], direct.ahead_bytes, l2);  // nothing for nullptr
      prefetch_row(direct.ahead[j][1], direct.ahead_bytes, l2);
      staged.k[j] = k ? kst + j * D : nullptr;
      staged.v[j] = k ? vst + j * D : nullptr;
      if (k)
        for (int64_t t = 0; t < nv; ++t) {
          store8(kst + j * D + 8 * t, load8(k + 8 * t));
          store8(vst + j * D + 8 * t, load8(v + 8 * t));
        }
    }
    const bool all_full = c0 >= all_lo && c0 + CHUNK <= all_hi, reuse = all_full && all_units > 0;
    int units = reuse ? all_units : 0;
    for (int r = 0; r < nrows && !reuse; ++r) {
      const int64_t rlo = std::max(a, rows[r].lo), rhi = std::min(e, rows[r].pos + 1);
      if (rhi <= c0 || rlo >= c0 + CHUNK) continue;  // none of this row's positions
      const bool full = rlo <= c0 && rhi >= c0 + CHUNK;  // no lane to mask
      if (!full)
        for (int64_t j = 0; j < CHUNK; ++j)
          valid[r][j] = (c0 + j >= rlo && c0 + j < rhi) ? 0.0f : NEG_INF;
      for (int g = 0; g < group; ++g, ++units) {
        qs[units] = q[r * group + g];
        outs[units] = rows[r].out + g * (D + 2);
        valids[units] = full ? nullptr : valid[r];
      }
    }
    all_units = all_full ? units : 0;
    if (stage) Chunk::template attend<NV>(staged, units, qs, outs, valids, scale, softcap, prs);
    else Chunk::template attend<NV>(direct, units, qs, outs, valids, scale, softcap, prs);
  }
}

// attend_tile: attend_chunks, or the chunk kernel's own loop over the item's chunks where it has
// one for these widths (Chunk::kSpan; then attend_chunks is not instantiated for them).
template <typename Chunk, int NV, typename KV>
void attend_tile(const float* const* q, const Row* rows, int nrows, int group, const KV* kbuf,
                 const KV* vbuf, int64_t row_stride, const int64_t* slots, int64_t a,
                 int64_t e, float scale, float softcap, float* kst, float* vst, float* prs,
                 bool l2) {
  constexpr bool span = [] {
    if constexpr (requires { Chunk::template kSpan<NV, KV>; }) return Chunk::template kSpan<NV, KV>;
    else return false;
  }();
  if constexpr (span)
    Chunk::template attend_span<NV>(q, rows, nrows, group, kbuf, vbuf, row_stride, slots, a, e,
                                    scale, softcap, l2);
  else
    attend_chunks<Chunk, NV, KV>(q, rows, nrows, group, kbuf, vbuf, row_stride, slots, a, e, scale,
                                 softcap, kst, vst, prs, l2);
}

template <typename Chunk, typename T, typename KV>
void run(const at::Tensor& q, const at::Tensor& kbuf, const at::Tensor& vbuf,
         const at::Tensor& req_to_token, const std::vector<int64_t>& seq_rows,
         const std::vector<int64_t>& prefix, const std::vector<int64_t>& extend, float scale,
         int64_t window, float softcap, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = kbuf.size(1);
  const int group = static_cast<int>(Hq / Hkv);
  const int64_t L = req_to_token.size(1);
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t ntok = q.size(0);
  // per token: its sequence, position, window start and the offset of its partials
  std::vector<int64_t> tok_seq(ntok), tok_pos(ntok), tok_lo(ntok), part_off(ntok + 1);
  std::vector<int64_t> seq_start(seq_rows.size());
  int64_t t = 0, nparts = 0;
  for (size_t b = 0; b < seq_rows.size(); ++b) {
    seq_start[b] = t;
    for (int64_t i = 0; i < extend[b]; ++i, ++t) {
      tok_seq[t] = static_cast<int64_t>(b);
      tok_pos[t] = prefix[b] + i;
      tok_lo[t] = window > 0 ? std::max<int64_t>(0, tok_pos[t] - window + 1) : 0;
      part_off[t] = nparts;
      nparts += tok_pos[t] / PART - tok_lo[t] / PART + 1;
    }
  }
  part_off[ntok] = nparts;
  const int64_t pstride = Hq * (D + 2);  // per (token, partition): per query head m, l, acc[D]
  // every (token, partition, head) partial is written by its work item before the merge
  // reads it: no zero fill (2.4 MB a 1,024-token prefill, one thread's memset while the
  // others waited: ~7% of the call)
  std::unique_ptr<float[]> partials(new float[nparts * pstride]);
  // Tiles of TILE query tokens where that leaves at least 4 (tile, KV head) items a thread,
  // else of SMALL_TILE: a bigger tile shares each chunk's K/V transposes and unit list among
  // more units (2 x 512 prefill +2%), but one 64-token prompt's 3 items on 2 threads took 34%
  // longer than its 6. Which tile a row falls in never changes its arithmetic.
  int64_t big_items = 0;
  for (size_t b = 0; b < seq_rows.size(); ++b) big_items += (extend[b] + TILE - 1) / TILE * Hkv;
  const int64_t tile = big_items >= 4 * at::get_num_threads() ? TILE : SMALL_TILE;
  std::vector<Item> items;
  for (size_t b = 0; b < seq_rows.size(); ++b) {
    for (int64_t i0 = 0; i0 < extend[b]; i0 += tile) {
      const int64_t n = std::min(tile, extend[b] - i0), first = seq_start[b] + i0;
      const int64_t plo = tok_lo[first] / PART, phi = tok_pos[first + n - 1] / PART;
      for (int64_t j = plo; j <= phi; ++j)
        for (int64_t h = 0; h < Hkv; ++h) items.push_back({(int64_t)b, first, n, j, h});
    }
  }
  const T* qp = q.data_ptr<T>();
  const int64_t q_stride = q.stride(0);
  const KV* kp = kbuf.data_ptr<KV>();
  const KV* vp = vbuf.data_ptr<KV>();
  // elements between slots and between heads: [C, Hkv, D] contiguous, or a view of a
  // head-major [Hkv, C, D] pool (kv_pool.py)
  const int64_t row_stride = kbuf.stride(0), head_stride = kbuf.stride(1);
  const bool l2 = prefetch_into_l2();
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(KV));
  T* op = out.data_ptr<T>();
  auto work = [&](int64_t w, ItemScratch& sc) {  // item w, on whichever thread takes it
    if constexpr (requires { Chunk::begin_item(); }) Chunk::begin_item();  // AMX: tile config
    float *qs = sc.qs.get(), *kst = sc.kst.get(), *vst = sc.vst.get(), *prs = sc.prs.get();
    const float* qrows[TILE * MAX_GROUP];
    Row rows[TILE];
    const Item& it = items[w];
    int nrows = 0;
    int64_t a = std::numeric_limits<int64_t>::max(), e = 0;
    for (int64_t r = 0; r < it.rows; ++r) {
      const int64_t tk = it.first + r;
      const int64_t j0 = tok_lo[tk] / PART;
      // a row whose positions miss this partition still gets an empty partial (l = 0)
      for (int g = 0; g < group; ++g) {
        const T* src = qp + tk * q_stride + (it.head * group + g) * D;
        if constexpr (Chunk::kPrescaled) {
          float* dst = qs + (nrows * group + g) * D;
          const __m256 f = _mm256_set1_ps(scale);
          for (int64_t d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(load8(src + d), f));
          qrows[nrows * group + g] = dst;
        } else {  // the chunk kernel reads q in place as it came (bfloat16 pairs)
          qrows[nrows * group + g] = reinterpret_cast<const float*>(src);
        }
      }
      rows[nrows].token = tk;
      rows[nrows].lo = std::max(tok_lo[tk], it.part * PART);
      rows[nrows].pos = std::min(tok_pos[tk], (it.part + 1) * PART - 1);
      if (it.part < j0 || it.part > tok_pos[tk] / PART) {
        rows[nrows].pos = rows[nrows].lo - 1;  // nothing to attend to here
        rows[nrows].out = nullptr;
      } else {
        rows[nrows].out = partials.get() + (part_off[tk] + it.part - j0) * pstride +
                          it.head * group * (D + 2);
      }
      if (rows[nrows].out == nullptr) continue;
      a = std::min(a, rows[nrows].lo);
      e = std::max(e, rows[nrows].pos + 1);
      ++nrows;
    }
    if (nrows == 0) return;
    // The first AHEAD positions' K/V rows of the next item (mostly this thread's next one):
    // the chunk kernel prefetches each row AHEAD positions before its load, so an item's first
    // chunk came from DRAM with nothing in flight. 2-core Zen 4, 30 layers' bf16 head-major
    // pools from DRAM, one build alternated 4 times: 1 x (4096 + 1) 0.109-0.113 -> 0.095-0.106
    // ms a layer, 16 x (512 + 1) 0.231-0.247 -> 0.217-0.236 (shuffled slots: 0.106-0.110 ->
    // 0.092-0.098, 0.231-0.236 -> 0.194-0.221); 64 or 128 positions were no better.
    if (w + 1 < static_cast<int64_t>(items.size())) {
      const Item& nx = items[w + 1];
      const auto [lo, end] = item_span(nx, tok_pos, tok_lo);
      const int64_t hi = std::min(end, lo + AHEAD);
      const int64_t* nslots = table + seq_rows[nx.seq] * L;
      const KV *nkp = kp + nx.head * head_stride, *nvp = vp + nx.head * head_stride;
      for (int64_t p = lo; p < hi; ++p) {
        prefetch_row(reinterpret_cast<const char*>(nkp + nslots[p] * row_stride), row_bytes, l2);
        prefetch_row(reinterpret_cast<const char*>(nvp + nslots[p] * row_stride), row_bytes, l2);
      }
    }
    auto call = [&](auto nv) {
      attend_tile<Chunk, decltype(nv)::value, KV>(
          qrows, rows, nrows, group, kp + it.head * head_stride, vp + it.head * head_stride,
          row_stride, table + seq_rows[it.seq] * L, a, e, scale, softcap, kst, vst, prs, l2);
    };
    switch (D / 8) {  // head_dim 8 .. 256 in steps of 8
#define SGL_NV(n) case n: call(std::integral_constant<int, n>{}); break;
      SGL_NV(1) SGL_NV(2) SGL_NV(3) SGL_NV(4) SGL_NV(5) SGL_NV(6) SGL_NV(7) SGL_NV(8)
      SGL_NV(9) SGL_NV(10) SGL_NV(11) SGL_NV(12) SGL_NV(13) SGL_NV(14) SGL_NV(15) SGL_NV(16)
      SGL_NV(17) SGL_NV(18) SGL_NV(19) SGL_NV(20) SGL_NV(21) SGL_NV(22) SGL_NV(23) SGL_NV(24)
      SGL_NV(25) SGL_NV(26) SGL_NV(27) SGL_NV(28) SGL_NV(29) SGL_NV(30) SGL_NV(31) SGL_NV(32)
#undef SGL_NV
    }
    // a token whose positions all lie in this partition: its output now, from the partial
    // still in this core's cache (the merge below skips it)
    for (int r = 0; r < nrows; ++r) {
      const int64_t tk = rows[r].token;
      if (part_off[tk + 1] - part_off[tk] != 1) continue;
      for (int g = 0; g < group; ++g)
        write_single_partial(rows[r].out + g * (D + 2),
                             op + (tk * Hq + it.head * group + g) * D, D);
    }
  };
  // each thread's range of about equal estimated cost, then the others' rest (run_items): a
  // 4-sequence decode step with one sequence verifying 4-7 drafts took 29-34% longer with
  // fixed ranges (30 layers at 600 positions: the verify tile's cost is overestimated)
  const std::vector<int64_t> bounds = split_by_cost(items, tok_pos, tok_lo, group);
  run_items(bounds, D, Chunk::kPrescaled, work);
  // merge each token's partitions in order (m in base 2 for a kBase2 kernel: 2^x = e^(x ln 2))
  merge_partials(partials.get(), part_off.data(), ntok, Hq, D,
                 Chunk::kBase2 ? 0.693147180559945309f : 1.0f, op);
}

// q [T, Hq, D] float32/bfloat16 (rows may be strided: a view into a fused qkv); k_buf, v_buf
// [C, Hkv, D] float32/bfloat16 with contiguous head rows, in any slot / head strides (both
// buffers alike: the CPU pool is a head-major view), already holding the new tokens' K/V;
// req_to_token [R, L] int64; req_rows, prefix_lens, extend_lens [B] int64 (CPU). Returns
// [T, Hq, D] in q's dtype.
template <typename Chunk>
at::Tensor attention_forward(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& req_to_token, const at::Tensor& req_rows,
                     const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale,
                     int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes(),
              "q must be [T, Hq, D] and the K/V buffers [C, Hkv, D]");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == D && D % 8 == 0 && D <= MAX_D, "head_dim must match, be a "
              "multiple of 8 and at most ", MAX_D, ", got ", D);
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= MAX_GROUP, "query heads (", Hq, ") must be a "
              "multiple of the KV heads (", Hkv, "), at most ", MAX_GROUP, " per KV head");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && req_to_token.is_contiguous(),
              "q's rows and req_to_token must be contiguous");
  TORCH_CHECK(k_buf.stride(2) == 1 && k_buf.strides() == v_buf.strides(), "the K/V buffers "
              "must have contiguous head rows and the same strides, got ", k_buf.strides(),
              " and ", v_buf.strides());
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong, "req_to_token must be int64");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "K and V buffers differ in dtype");
  auto to_vec = [](const at::Tensor& t) {
    auto c = t.to(at::kLong).contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  };
  const auto rows = to_vec(req_rows), prefix = to_vec(prefix_lens), extend = to_vec(extend_lens);
  TORCH_CHECK(rows.size() == prefix.size() && rows.size() == extend.size(),
              "req_rows, prefix_lens and extend_lens must have one entry per sequence");
  int64_t total = 0;
  for (size_t b = 0; b < rows.size(); ++b) {
    TORCH_CHECK(prefix[b] + extend[b] <= req_to_token.size(1), "sequence ", b, " is longer "
                "than the request table");
    total += extend[b];
  }
  TORCH_CHECK(total == q.size(0), "q has ", q.size(0), " tokens, extend_lens sum to ", total);
  auto out = at::empty({q.size(0), Hq, D}, q.options());
  const bool q32 = q.scalar_type() == at::kFloat, kv32 = k_buf.scalar_type() == at::kFloat;
  TORCH_CHECK(q32 || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(kv32 || k_buf.scalar_type() == at::kBFloat16, "KV must be float32 or bfloat16");
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (q32 && kv32) run<Chunk, float, float>(q, k_buf, v_buf, req_to_token, rows, prefix, extend, s, window, cap, out);
  else if (q32) run<Chunk, float, c10::BFloat16>(q, k_buf, v_buf, req_to_token, rows, prefix, extend, s, window, cap, out);
  else if (kv32) run<Chunk, c10::BFloat16, float>(q, k_buf, v_buf, req_to_token, rows, prefix, extend, s, window, cap, out);
  else run<Chunk, c10::BFloat16, c10::BFloat16>(q, k_buf, v_buf, req_to_token, rows, prefix, extend, s, window, cap, out);
  return out;
}

}  // namespace
}  // namespace sgl_cpu
