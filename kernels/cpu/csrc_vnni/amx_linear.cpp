// The int4 linear layers on AMX bf16 tiles, for prefill-sized passes (sgl_cpu_vnni::amx_*):
// each 16-feature tile of the VNNI int4 weight (packed_layout.h) is dequantized once a call
// into a bf16 panel of one per-call buffer, all tiles in parallel (w = d * q + m in float32,
// FMA, rounded to nearest even bf16), and the bf16 activations are multiplied with it by
// TDPBF16PS (16 rows x 16 features x 32 inputs an instruction, float32 accumulation in the
// tile over all of K): 2 x 2 tiles of 16 rows and 16 features a step, as oneDNN's brgemm
// blocks them (Intel's AMX programming reference, "Intel Advanced Matrix Extensions",
// Architecture Instruction Set Extensions Programming Reference ch. 3). No int8 activations
// and no per-block float epilogue: that epilogue (a tile store and 4 float ops a row every 32
// inputs) held the int8 tiles (TDPBSUD) to 0.3-0.4 TOP/s a core here, the VNNI kernel's rate.
//
// Numerics: the weights are the dequantized int4 values rounded to bf16 (what the dense bf16
// copies this replaces held), the activations bf16 as given (float32 ones are rounded first),
// sums in float32 in k order 32 inputs at a time (the order within an instruction is the
// hardware's). Not the VNNI kernel's bits (that one quantizes the activations to int8), so a
// token's logits depend on whether its pass ran here: the caller uses it only for passes of
// many rows, as it used the dense copies. Each output row depends only on its own input row.
//
// Compiled into the VNNI library (kernels/cpu/build.py) with per-function targets
// (amx-tile, amx-bf16, avx512bf16, avx512vbmi), so the rest of the library still runs on AVX-512 VNNI
// CPUs without them; amx_available() says whether this machine and its kernel allow the tiles.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include "../csrc/linear_inputs.h"
#include "../csrc/work_ranges.h"
#include "amx_tiles.h"
#include "packed_layout.h"
#include "vec512.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512vbmi")))

namespace sgl_cpu_vnni {
namespace {

constexpr int64_t PANEL_BLOCK = 16 * 32;  // bf16 of a (tile, 32-input block): 16 pair rows x 32
constexpr int64_t ROWS = 32;              // activation rows a step (two 16-row A tiles)

// Linux keeps the tile data state off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA; Documentation/arch/x86/xstate.rst); a tile instruction before that
// faults. Asked once per process.
bool tiles_permitted() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vbmi"))
      return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Tile t of a packed int4 weight (its G blocks at w) -> panel [G][16 pair rows][16 features]
// [2] bf16: pair row p of block g holds inputs 32 g + 2 p, 32 g + 2 p + 1 of every feature (B's
// layout for TDPBF16PS). Chunk c of a packed block holds inputs 8c .. 8c + 3 in the low
// nibbles of feature f's dword and 8c + 4 .. 8c + 7 in the high ones, so each nibble vector
// gives two pair rows.
AMX_TARGET void dequantize_q4_tile(const uint8_t* w, int64_t G, c10::BFloat16* panel) {
  alignas(64) uint8_t pick[64];  // bytes of pair row 2h + e from dword bytes 4f + 2h + e
  for (int h = 0; h < 2; ++h)
    for (int f = 0; f < 16; ++f)
      for (int e = 0; e < 2; ++e) pick[32 * h + 2 * f + e] = uint8_t(4 * f + 2 * h + e);
  const __m512i sel = _mm512_load_si512(pick);
  // lane i of the first / second half of a pair row belongs to feature i / 2 / 8 + i / 2
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = w + g * Q4_BLOCK;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
    const __m512 d0 = _mm512_permutexvar_ps(dup_lo, d), d1 = _mm512_permutexvar_ps(dup_hi, d);
    const __m512 m0 = _mm512_permutexvar_ps(dup_lo, m), m1 = _mm512_permutexvar_ps(dup_hi, m);
    __m512i* out = reinterpret_cast<__m512i*>(panel + g * PANEL_BLOCK);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(b + 64 + 64 * c);
      const __m512i nib[2] = {_mm512_and_si512(v, low),
                              _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
      for (int s = 0; s < 2; ++s) {  // inputs 8c + 4s .. 8c + 4s + 3: pair rows 4c + 2s + h
        const __m512i q = _mm512_permutexvar_epi8(sel, nib[s]);
        for (int h = 0; h < 2; ++h) {
          const __m512 lo = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(q, 2 * h))), d0, m0);
          const __m512 hi = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(q, 2 * h + 1))), d1, m1);
          _mm512_store_si512(out + 4 * c + 2 * s + h, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      }
    }
  }
}

// c [32][32] float32 = rows a (two 16-row A tiles at a, a + 16 lda; lda in elements) times the
// panels b0, b1 (two 16-feature tiles) over G blocks of 32 inputs. Tiles (TileConfig): tmm0-3 C
// (float32), tmm4-5 A (activation rows), tmm6-7 B (weight pair rows). Each operand is loaded for
// the next block right after this block's last TDPBF16PS that reads it is issued, so the loads
// run under the multiplies: where tile loads bound the step (~50 cycles each in the VM's slow
// phases, as long as 3 TDPBF16PS), 508-535 -> 584-605 GFLOP/s a core in a /tmp model of the
// loop (K = 576 and 1536, 448 rows of L2-resident activations, 2026-11-29).
//
// between(r0, r1) runs in G - 1 slices (one where G is 1), rows [0, 32) split over the loop's
// iterations, after each iteration's tile instructions: the previous step's epilogue (vector
// work) issued among the tile instructions runs while the tile unit multiplies, where after
// them it ran alone.
template <typename Between>
AMX_TARGET void tile_2x2(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b0,
                         const c10::BFloat16* b1, int64_t G, float* c, Between&& between) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = lda * 2;
  _tile_loadd(4, a, stride);
  _tile_loadd(6, b0, 64);
  _tile_loadd(5, a + 16 * lda, stride);
  _tile_loadd(7, b1, 64);
  for (int64_t g = 1; g < G; ++g) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(4, a + 32 * g, stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(6, b0 + g * PANEL_BLOCK, 64);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(5, a + 16 * lda + 32 * g, stride);
    _tile_loadd(7, b1 + g * PANEL_BLOCK, 64);
    between(ROWS * (g - 1) / (G - 1), ROWS * g / (G - 1));
  }
  if (G == 1) between(0, ROWS);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

// The per-thread scratch: a zero-padded copy of a last partial step of rows and two buffers for
// the C tiles' float32 output (a step's, and the previous step's until its epilogue is done),
// 64-byte aligned.
struct Scratch {
  std::vector<c10::BFloat16> tail;
  std::vector<float> c;
  explicit Scratch(int64_t K) : tail(ROWS * K), c(2 * ROWS * 32 + 16) {}
  float* c_tiles(int i) {
    const uintptr_t p = (reinterpret_cast<uintptr_t>(c.data()) + 63) & ~uintptr_t(63);
    return reinterpret_cast<float*>(p) + i * ROWS * 32;
  }
};

// Activation bytes a block of rows may take, so that it stays in a core's L2 while the thread's
// weight panels stream past it (2 MB L2 on Sapphire Rapids; unblocked, a 2,048-row pass read
// its rows from L3 for every pair of tiles: 0.8 -> 0.5 of the 512-row rate).
constexpr int64_t ROW_BLOCK_BYTES = 512 * 1024;

// y = xb [M, K] bf16 times the packed weight's `tiles` tiles: every tile is dequantized into one
// bf16 buffer first (each once a call, in parallel), then each thread takes a contiguous range
// of tile pairs and runs it over the rows block by block (ROW_BLOCK_BYTES): out(m0, r0, r1, c,
// u) gets rows [r0, r1) of each 32-row step's c [32][32] float32 of tile pair u (columns 0-15
// tile 2u, 16-31 tile 2u + 1, or tile 2u again where that is the last; with gate_up, a fused
// [gate; up] weight's tiles u and tiles / 2 + u: a feature's gate and up side by side), right
// after the step, or with OVERLAP during the next step's tile work (tile_2x2's `between`; the
// item's last step after it): for the SiLU epilogue (~25% of the step's time alone) 0.81-0.87x
// the time, for a plain store 1.00-1.08x (the slices' overhead; two builds taking turns call by
// call, 30 rounds, 2026-11-29).
template <bool OVERLAP, typename Out>
void run_tiles(const c10::BFloat16* xb, int64_t M, int64_t K, const uint8_t* w, int64_t tiles,
               Out out, bool gate_up = false) {
  const int64_t G = K / QK, tile_bytes = G * Q4_BLOCK;
  const int64_t units = gate_up ? tiles / 2 : (tiles + 1) / 2;
  auto panels = at::empty({tiles * G * PANEL_BLOCK}, at::kBFloat16);  // 64-byte aligned
  c10::BFloat16* pp = panels.data_ptr<c10::BFloat16>();
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) dequantize_q4_tile(w + t * tile_bytes, G, pp + t * G * PANEL_BLOCK);
  });
  const int64_t rows_per_block = std::max<int64_t>(ROWS, ROW_BLOCK_BYTES / (2 * K) / ROWS * ROWS);
  const int64_t blocks = (M + rows_per_block - 1) / rows_per_block;
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  auto len = [&](int64_t r) { return units * (r + 1) / n - units * r / n; };
  sgl_cpu::run_ranges_with(
      n, [&](int64_t r) { return blocks * len(r); }, 1,
      [&] {
        load_tile_config();
        return Scratch(K);
      },
      [&](Scratch& s, int64_t r, int64_t i) {  // items block-major: a block's rows stay in L2
        const int64_t u = units * r / n + i % len(r), m1 = std::min(M, (i / len(r) + 1) * rows_per_block);
        const int64_t t0 = gate_up ? u : 2 * u, t1 = gate_up ? units + u : std::min(2 * u + 1, tiles - 1);
        const c10::BFloat16* p0 = pp + t0 * G * PANEL_BLOCK;
        const c10::BFloat16* p1 = pp + t1 * G * PANEL_BLOCK;
        float *c = s.c_tiles(0), *prev = s.c_tiles(1);
        int64_t prev_m0 = -1, prev_rows = 0;
        auto epilogue = [&](int64_t r0, int64_t r1) {  // of the previous step, rows [r0, r1)
          if (prev_m0 >= 0 && r0 < prev_rows) out(prev_m0, r0, std::min(r1, prev_rows), prev, u);
        };
        for (int64_t m0 = i / len(r) * rows_per_block; m0 < m1; m0 += ROWS) {
          const int64_t rows = std::min(ROWS, M - m0);
          const c10::BFloat16* a = xb + m0 * K;
          if (rows < ROWS) {  // the tiles read 32 rows: pad with zeros
            c10::BFloat16* t = s.tail.data();
            std::copy(a, a + rows * K, t);
            std::fill(t + rows * K, t + ROWS * K, c10::BFloat16(0.0f));
            a = t;
          }
          if constexpr (OVERLAP) {
            tile_2x2(a, K, p0, p1, G, c, epilogue);
            std::swap(c, prev);
            prev_m0 = m0;
            prev_rows = rows;
          } else {
            tile_2x2(a, K, p0, p1, G, c, [](int64_t, int64_t) {});
            out(m0, 0, rows, c, u);
          }
        }
        if constexpr (OVERLAP) epilogue(0, ROWS);  // the item's last step
      });
}

void check_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t K) {
  TORCH_CHECK(tiles_permitted(), "the AMX kernels need a CPU with AMX-BF16 and a kernel that "
              "grants the tile state (amx_available() is false here)");
  sgl_cpu::check_x(x, K, QK);
  const int64_t tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == tiles && packed.size(1) == K / QK * Q4_BLOCK &&
              packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed must be a contiguous [", tiles, ", ", K / QK * Q4_BLOCK,
              "] uint8 tensor (sgl_cpu_vnni.pack_int4 of a [", N, ", K] weight)");
}

}  // namespace

bool amx_available() { return tiles_permitted(); }

// x [M, K] float32/bfloat16, packed from pack_int4 -> y [M, N] in x's dtype.
at::Tensor amx_int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + TILE - 1) / TILE;
  check_amx(x, packed, N, K);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
  auto run = [&](auto* yp) {
    run_tiles<false>(xb.data_ptr<c10::BFloat16>(), M, K, packed.data_ptr<uint8_t>(), tiles,
              [&](int64_t m0, int64_t r0, int64_t r1, const float* c, int64_t u) {
                for (int i = 0; i < 2 && 2 * u + i < tiles; ++i) {
                  const int64_t n0 = (2 * u + i) * TILE;
                  const __mmask16 mask = sgl_cpu::lanes(N - n0);
                  for (int64_t r = r0; r < r1; ++r)
                    sgl_cpu::store16(yp + (m0 + r) * N + n0, _mm512_load_ps(c + 32 * r + 16 * i), mask);
                }
              });
  };
  if (x.scalar_type() == at::kFloat) run(y.data_ptr<float>());
  else run(y.data_ptr<c10::BFloat16>());
  return y;
}

// x [M, K] float32/bfloat16, packed from pack_int4 of a fused [gate; up] weight [N = 2 I, K]
// (I a multiple of 16) -> silu(x @ gate.T) * (x @ up.T) [M, I] in x's dtype: bitwise
// silu_mul(amx_int4_linear(x, packed, N)) (each sum rounded to x's dtype, then
// sgl_cpu::silu_times, as silu_mul computes it), without the [M, N] intermediate or a second
// pass over it (silu_mul was 8% of a 500-token prefill on the AMX default, 2026-11-29).
at::Tensor amx_int4_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + TILE - 1) / TILE, I = N / 2;
  check_amx(x, packed, N, K);
  TORCH_CHECK(N % (2 * TILE) == 0, "amx_int4_linear_silu: N = 2 I needs I a multiple of ", TILE,
              ", got N = ", N);
  auto y = at::empty({M, I}, x.options());
  if (M == 0) return y;
  const at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
  auto run = [&](auto* yp) {
    using T = std::remove_pointer_t<decltype(yp)>;
    run_tiles<true>(xb.data_ptr<c10::BFloat16>(), M, K, packed.data_ptr<uint8_t>(), tiles,
              [&](int64_t m0, int64_t r0, int64_t r1, const float* c, int64_t u) {
                for (int64_t r = r0; r < r1; ++r) {
                  const __m512 g = sgl_cpu::round_to<T>(_mm512_load_ps(c + 32 * r));
                  const __m512 v = sgl_cpu::round_to<T>(_mm512_load_ps(c + 32 * r + 16));
                  sgl_cpu::store16(yp + (m0 + r) * I + u * TILE, sgl_cpu::silu_times<T>(g, v));
                }
              }, /*gate_up=*/true);
  };
  if (x.scalar_type() == at::kFloat) run(y.data_ptr<float>());
  else run(y.data_ptr<c10::BFloat16>());
  return y;
}

}  // namespace sgl_cpu_vnni

TORCH_LIBRARY_FRAGMENT(sgl_cpu_vnni, m) {
  m.def("amx_available() -> bool", &sgl_cpu_vnni::amx_available);
  m.def("amx_int4_linear(Tensor x, Tensor packed, int N) -> Tensor");
  m.def("amx_int4_linear_silu(Tensor x, Tensor packed, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_cpu_vnni, CPU, m) {
  m.impl("amx_int4_linear", &sgl_cpu_vnni::amx_int4_linear);
  m.impl("amx_int4_linear_silu", &sgl_cpu_vnni::amx_int4_linear_silu);
}
