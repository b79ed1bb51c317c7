// y = x W^T for the CPU, with W in fp32, bf16, int8 or int4: with fp32 activations, or for int8 and
// int4 weights with int8 activations (W8A8, W4A8), below.
//
// Every format is stored packed, once at load, in panels of 32 output columns, so each panel is
// one contiguous stream read in the order the kernel uses it (services/executor/engine/linear.py packs):
//   fp32: P  fp32  [N/32, K, 32]                                             w = P
//   bf16: P  bf16  [N/32, K, 32]  (K a multiple of 32)                       w = P, widened
//   int8: q  int8  [N/32, K, 32],  scale fp32 [N/32, K/32, 32]               w = scale * q
//   int4: q  uint8 [N/32, K, 16],  scale, min fp32 [N/32, K/32, 32]          w = scale * q + min
//         byte c of a step of k holds column c in its low nibble and column c + 16 in its high one.
// Scales (and mins) are per group of 32 along K and per column: the layout of GGUF's Q8_0, Q4_0
// and Q4_1 blocks, turned on its side.
//
// A register tile holds up to 12 rows of x times the panel's 32 columns (24 accumulators) and adds
// x[i, k] * w[k, :] for every k: no horizontal sums. Decode steps (a few rows) are bound by how
// fast the weights stream in, so the stream is asked for well ahead of its use (one core alone
// cannot keep enough lines in flight while it also computes), and quantized weights are
// dequantized in registers as they arrive. Prefill (many rows) is bound by the FMAs: a quantized
// panel is then dequantized once into an fp32 scratch panel in L2 (or, with many_rows "bf16",
// into bfloat16 pairs for vdpbf16ps), and every tile of x runs over it, so dequantizing costs once
// per panel rather than once per tile. Past 96 rows, fp32 FMAs take x in blocks that stay in L2;
// bf16 dot products take x rounded to pairs, from 96 rows laid out tile by tile (x_tiles).
// That is the AVX-512 path. Without AVX-512, an AVX2 build (16 registers of 8 lanes) has smaller
// tiles of its own (below): one or two rows dequantize in registers, more rows read an fp32 panel
// (a quantized one dequantized first); without AVX2, plain loops the compiler vectorizes.
//
// With int8 activations (where the CPU has AVX512-VNNI; AVX2 without it, further below, multiplies
// the same codes and quads as 16-bit integers), x is quantized on entry per row and group
// of 32 along K, asymmetrically (the group's own range, as GGUF's Q4_1 stores weights): x ~ sx * u
// + lo, u in 0..255, sx = (max - min) / 255, lo = min. One vpdpbusd multiplies 64 unsigned bytes
// of x by 64 signed bytes of weights and adds them four at a time into 16 int32 sums: four times
// the products of an fp32 FMA, with no dequantizing in the loop. Over a group,
//   sum_t w_t x_t = sx * sum_t w_t u_t + lo * sum_t w_t,
// so each group ends with its int32 sums scaled into fp32 and the weights' own group sums (packed
// with them) times lo. The weights are laid out in quads of four consecutive k per column (each
// 32-bit lane one column's four weights), signed:
//   w8a8: q int8  [N/32, K/4, 32, 4]                                     w = scale * q
//   w4a8: q uint8 [N/32, K/4, 16, 4]  (low nibble column c, high c + 16)  w = scale * (q - 8) + min
//   both: sums fp32 [N/32, K/32, 32], each group's sum of w
// (w4a8's min is Q4_1's min + 8 * scale: its levels are centred on zero to be signed bytes.)
// Measured against symmetric Q8_0 activations on SmolLM2 (BENCHMARKS), the group's range halves
// the next-token KL the activations add.

#include "ops.h"
#include "amx_tiles.h"
#include "attention_simd.h"
#include "bf16_simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;  // weights per scale along K
constexpr int kPanel = 32;      // output columns per panel
constexpr int kPanelRows = 12;  // rows of x per register tile

enum class Format { F32, BF16, Int8, Int4, W8A8, W4A8 };

// Scratch that is written in full before it is read: not zeroed first (a 512-row call's x as
// bf16 is over a megabyte).
template <typename T>
std::unique_ptr<T[]> scratch_of(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

struct Panels {
  Format format;
  int64_t num_panels, k;
  int64_t n;  // valid output columns: the last panel may be padding past them
  const float* f32 = nullptr;
  const uint16_t* b16 = nullptr;  // bf16 bits
  const int8_t* q8 = nullptr;
  const uint8_t* q4 = nullptr;
  const float* scale = nullptr;
  const float* sums = nullptr;  // W8A8, W4A8: each group's sum of w
  const float* min = nullptr;

  int64_t groups() const { return k / kGroup; }

  // Panel j dequantized into out [K, 32] (the portable path, the prefill scratch, BLAS blocks).
  void dequant(int64_t j, float* out, int64_t out_stride = kPanel) const;
};

void Panels::dequant(int64_t j, float* out, int64_t out_stride) const {
  for (int64_t t = 0; t < k; ++t) {
    float* row = out + t * out_stride;
    if (format == Format::F32) {
      std::copy(f32 + (j * k + t) * kPanel, f32 + (j * k + t + 1) * kPanel, row);
      continue;
    }
    if (format == Format::BF16) {
      for (int c = 0; c < kPanel; ++c) {
        const uint32_t bits = static_cast<uint32_t>(b16[(j * k + t) * kPanel + c]) << 16;
        std::memcpy(row + c, &bits, sizeof bits);
      }
      continue;
    }
    const float* s = scale + (j * groups() + t / kGroup) * kPanel;
    if (format == Format::W8A8) {
      const int8_t* quad = q8 + (j * (k / 4) + t / 4) * kPanel * 4 + t % 4;
      for (int c = 0; c < kPanel; ++c) row[c] = s[c] * quad[c * 4];
      continue;
    }
    if (format == Format::W4A8) {
      const uint8_t* quad = q4 + (j * (k / 4) + t / 4) * kPanel * 2 + t % 4;
      const float* m = min + (j * groups() + t / kGroup) * kPanel;
      for (int c = 0; c < kPanel; ++c) {
        const uint8_t byte = quad[(c % (kPanel / 2)) * 4];
        row[c] = s[c] * ((c < kPanel / 2 ? byte & 0xF : byte >> 4) - 8) + m[c];
      }
      continue;
    }
    if (format == Format::Int8) {
      const int8_t* q = q8 + (j * k + t) * kPanel;
      for (int c = 0; c < kPanel; ++c) row[c] = s[c] * q[c];
    } else {
      const uint8_t* q = q4 + (j * k + t) * (kPanel / 2);
      const float* m = min + (j * groups() + t / kGroup) * kPanel;
      for (int c = 0; c < kPanel / 2; ++c) {
        row[c] = s[c] * (q[c] & 0xF) + m[c];
        row[c + kPanel / 2] = s[c + kPanel / 2] * (q[c] >> 4) + m[c + kPanel / 2];
      }
    }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// Asks for [p, p + bytes) into L2 (a hint: never faults, wherever p points).
inline void request(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}
#endif

// Calls tile.template operator()<R>(m0) for tiles of R <= MaxRows rows covering [0, m), as even
// as they can be (13 rows in tiles of 12 run as 6 + 7, not 12 + 1).
template <int MaxRows = kPanelRows, typename Tile>
void for_each_tile(int64_t m, const Tile& tile) {
  const int64_t tiles = (m + MaxRows - 1) / MaxRows;
  int64_t m0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = (m - m0) / (tiles - t);
    switch (rows) {
#define JETSERVE_TILE(R)                                    \
  case R:                                                   \
    if constexpr (R <= MaxRows) tile.template operator()<R>(m0); \
    break;
      JETSERVE_TILE(1) JETSERVE_TILE(2) JETSERVE_TILE(3) JETSERVE_TILE(4) JETSERVE_TILE(5)
      JETSERVE_TILE(6) JETSERVE_TILE(7) JETSERVE_TILE(8) JETSERVE_TILE(9) JETSERVE_TILE(10)
      JETSERVE_TILE(11) JETSERVE_TILE(12)
#undef JETSERVE_TILE
      default: break;  // rows is 1 .. MaxRows by construction
    }
    m0 += rows;
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// A share of the next panel's stream (its weights, and for int8 and int4 its scales and mins:
// up to three ranges), asked for into L2 while this panel's tiles compute: a line of each range
// every `every` steps of k of the tile, so the stream arrives spread over the whole panel's
// work. (Asked for only by the first tile, ahead of its use, the stream came in at the pace of
// that tile's FMAs: 6 rows by 16 columns of a 576-deep panel take a microsecond a core, a 72 KB
// panel would need 70 GB/s.)
struct Ahead {
  const char* p[3] = {};
  int64_t lines[3] = {};
  int64_t every = int64_t{1} << 40;  // none: past any k, and far from overflowing t + every

  // Share n of `shares` of panel j's stream, over a tile of k steps.
  static Ahead share(const Panels& w, int64_t j, int64_t n, int64_t shares) {
    Ahead a;
    const int64_t groups = w.groups() * kPanel;
    switch (w.format) {
      case Format::F32: a.add(0, w.f32 + j * w.k * kPanel, w.k * kPanel * 4, n, shares); break;
      case Format::BF16: a.add(0, w.b16 + j * w.k * kPanel, w.k * kPanel * 2, n, shares); break;
      case Format::Int8:
        a.add(0, w.q8 + j * w.k * kPanel, w.k * kPanel, n, shares);
        a.add(1, w.scale + j * groups, groups * 4, n, shares);
        break;
      case Format::Int4:
        a.add(0, w.q4 + j * w.k * (kPanel / 2), w.k * kPanel / 2, n, shares);
        a.add(1, w.scale + j * groups, groups * 4, n, shares);
        a.add(2, w.min + j * groups, groups * 4, n, shares);
        break;
      default: break;  // W8A8 and W4A8 run on their own tiles
    }
    a.pace(w.k);
    return a;
  }

  void add(int r, const void* base, int64_t bytes, int64_t n, int64_t shares) {
    const int64_t all = (bytes + 63) / 64, first = all * n / shares;
    p[r] = static_cast<const char*>(base) + 64 * first;
    lines[r] = all * (n + 1) / shares - first;
  }

  void pace(int64_t steps) {
    const int64_t most = std::max({lines[0], lines[1], lines[2]});
    every = std::max<int64_t>(1, steps / std::max<int64_t>(most, 1));
  }

  inline void next() {
#pragma GCC unroll 3
    for (int r = 0; r < 3; ++r) {
      if (lines[r] > 0) {
        _mm_prefetch(p[r], _MM_HINT_T1);
        p[r] += 64;
        --lines[r];
      }
    }
  }
};
#endif

#if defined(__AVX512F__)
// How far ahead of its use a panel's stream is requested: 64 steps of k (8 KB of fp32, 4 KB of
// bf16), 8 groups of int8 (9 KB) or int4 (6 KB).
constexpr int64_t kF32Ahead = 64;
constexpr int64_t kGroupsAhead = 8;
// Past this many rows of x, a quantized panel is dequantized once into scratch for all of them.
constexpr int64_t kScratchRows = 8;

// One panel's weights as F, dequantized a step of k (32 columns, two vectors) at a time. Reads
// past the panel's end are only ever prefetch hints, which never fault.
template <Format F>
struct PanelReader {
  const float* f;
  const uint16_t* b;
  const int8_t* q8;
  const uint8_t* q4;
  const float* s;
  const float* m;
  __m512 s_lo, s_hi, m_lo, m_hi;

  PanelReader(const Panels& w, int64_t j) {
    if constexpr (F == Format::F32) {
      f = w.f32 + j * w.k * kPanel;
    } else if constexpr (F == Format::BF16) {
      b = w.b16 + j * w.k * kPanel;
    } else {
      s = w.scale + j * w.groups() * kPanel;
      if constexpr (F == Format::Int8) q8 = w.q8 + j * w.k * kPanel;
      if constexpr (F == Format::Int4) {
        q4 = w.q4 + j * w.k * (kPanel / 2);
        m = w.min + j * w.groups() * kPanel;
      }
    }
  }

  // Group g's scales into registers, and group g + kGroupsAhead asked for.
  inline void start_group(int64_t g) {
    if constexpr (F == Format::Int8 || F == Format::Int4) {
      s_lo = _mm512_loadu_ps(s + g * kPanel);
      s_hi = _mm512_loadu_ps(s + g * kPanel + 16);
      const int64_t ahead = g + kGroupsAhead;
      request(s + ahead * kPanel, kPanel * 4);
      if constexpr (F == Format::Int8) request(q8 + ahead * kGroup * kPanel, kGroup * kPanel);
      if constexpr (F == Format::Int4) {
        m_lo = _mm512_loadu_ps(m + g * kPanel);
        m_hi = _mm512_loadu_ps(m + g * kPanel + 16);
        request(m + ahead * kPanel, kPanel * 4);
        request(q4 + ahead * kGroup * (kPanel / 2), kGroup * kPanel / 2);
      }
    }
  }

  inline void load(int64_t t, __m512& lo, __m512& hi) const {
    if constexpr (F == Format::F32) {
      request(f + (t + kF32Ahead) * kPanel, kPanel * 4);
      lo = _mm512_loadu_ps(f + t * kPanel);
      hi = _mm512_loadu_ps(f + t * kPanel + 16);
    } else if constexpr (F == Format::BF16) {  // a bf16 is the high half of an fp32
      request(b + (t + kF32Ahead) * kPanel, kPanel * 2);
      const __m512i w = _mm512_loadu_si512(b + t * kPanel);
      lo = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
      hi = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
    } else if constexpr (F == Format::Int8) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + t * kPanel));
      lo = _mm512_mul_ps(s_lo, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
      hi = _mm512_mul_ps(s_hi,
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    } else {
      const __m512i bytes = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q4 + t * (kPanel / 2))));
      lo = _mm512_fmadd_ps(s_lo, _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF))),
                           m_lo);
      hi = _mm512_fmadd_ps(s_hi, _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), m_hi);
    }
  }
};

// The first `cols` of a panel's 32 outputs (the last panel of an N that is not a multiple of 32).
inline void store(float* y, __m512 lo, __m512 hi, int cols) {
  if (cols == kPanel) {
    _mm512_storeu_ps(y, lo);
    _mm512_storeu_ps(y + 16, hi);
  } else {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << std::min(cols, 16)) - 1), lo);
    if (cols > 16) _mm512_mask_storeu_ps(y + 16, static_cast<__mmask16>((1u << (cols - 16)) - 1), hi);
  }
}

// y[0 .. MR, 0 .. cols) = x[0 .. MR, :] w^T for one panel.
template <Format F, int MR>
void panel_tile(PanelReader<F> w, int64_t k, const float* x, int64_t x_stride, float* y,
                int64_t y_stride, int cols, Ahead ahead) {
  __m512 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  int64_t soon = 0;  // the step that asks for the next line of the next panel
  for (int64_t g = 0; g * kGroup < k; ++g) {
    w.start_group(g);
    for (int64_t t = g * kGroup; t < std::min(k, (g + 1) * kGroup); ++t) {
      if (t == soon) {
        ahead.next();
        soon += ahead.every;
      }
      __m512 w_lo, w_hi;
      w.load(t, w_lo, w_hi);
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = _mm512_set1_ps(x[i * x_stride + t]);
        lo[i] = _mm512_fmadd_ps(xv, w_lo, lo[i]);
        hi[i] = _mm512_fmadd_ps(xv, w_hi, hi[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) store(y + i * y_stride, lo[i], hi[i], cols);
}

// One row of x: two accumulators would be one FMA chain per vector, waiting on its own latency;
// four steps of k at a time keep eight chains going.
template <Format F>
void panel_row(PanelReader<F> w, int64_t k, const float* x, float* y, int cols) {
  __m512 acc[8];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t g = 0; g * kGroup < k; ++g) {
    w.start_group(g);
    const int64_t end = std::min(k, (g + 1) * kGroup);
    int64_t t = g * kGroup;
    for (; t + 4 <= end; t += 4) {
      for (int u = 0; u < 4; ++u) {
        __m512 w_lo, w_hi;
        w.load(t + u, w_lo, w_hi);
        const __m512 xv = _mm512_set1_ps(x[t + u]);
        acc[2 * u] = _mm512_fmadd_ps(xv, w_lo, acc[2 * u]);
        acc[2 * u + 1] = _mm512_fmadd_ps(xv, w_hi, acc[2 * u + 1]);
      }
    }
    for (; t < end; ++t) {  // fp32 only: K need not be a multiple of 4 there
      __m512 w_lo, w_hi;
      w.load(t, w_lo, w_hi);
      const __m512 xv = _mm512_set1_ps(x[t]);
      acc[0] = _mm512_fmadd_ps(xv, w_lo, acc[0]);
      acc[1] = _mm512_fmadd_ps(xv, w_hi, acc[1]);
    }
  }
  store(y, _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[4], acc[6])),
        _mm512_add_ps(_mm512_add_ps(acc[1], acc[3]), _mm512_add_ps(acc[5], acc[7])), cols);
}

// Every row of x against one panel.
template <Format F>
void panel_rows(PanelReader<F> w, int64_t k, const float* x, int64_t x_stride, float* y,
                int64_t y_stride, int64_t m, int cols, const Panels& all, int64_t next) {
  if (m == 1) {
    panel_row(w, k, x, y, cols);
    return;
  }
  const int64_t tiles = (m + kPanelRows - 1) / kPanelRows;
  int64_t tile = 0;
  for_each_tile(m, [&]<int R>(int64_t m0) {
    const Ahead a = next < 0 ? Ahead{} : Ahead::share(all, next, tile++, tiles);
    panel_tile<F, R>(w, k, x + m0 * x_stride, x_stride, y + m0 * y_stride, y_stride, cols, a);
  });
}

// A quantized panel dequantized to fp32, [K, 32].
template <Format F>
void dequant_panel(const Panels& w, int64_t j, float* out) {
  PanelReader<F> panel(w, j);
  for (int64_t g = 0; g < w.groups(); ++g) {
    panel.start_group(g);
    for (int64_t t = g * kGroup; t < (g + 1) * kGroup; ++t) {
      __m512 lo, hi;
      panel.load(t, lo, hi);
      _mm512_storeu_ps(out + t * kPanel, lo);
      _mm512_storeu_ps(out + t * kPanel + 16, hi);
    }
  }
}

template <Format F>
void panels_run(const Panels& w, const float* x, int64_t x_stride, float* y, int64_t m) {
  at::parallel_for(0, w.num_panels, 1, [&](int64_t begin, int64_t end) {
    const bool dequantized = F != Format::F32 && m > kScratchRows;
    const auto scratch = scratch_of<float>(dequantized ? w.k * kPanel : 0);
    const Panels dense{Format::F32, 1, w.k, w.n, scratch.get()};
    for (int64_t j = begin; j < end; ++j) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, w.n - j * kPanel));
      float* yj = y + j * kPanel;
      // This thread's next panel, asked for across this one's tiles where there are several or
      // the tiles read a dequantized copy (one tile over the weights asks for them itself).
      const bool ask = dequantized || m > kPanelRows;
      const int64_t next = j + 1 < end && ask ? j + 1 : -1;
      if (!dequantized) {
        panel_rows(PanelReader<F>(w, j), w.k, x, x_stride, yj, w.n, m, cols, w, next);
      } else {
        dequant_panel<F>(w, j, scratch.get());
        panel_rows(PanelReader<Format::F32>(dense, 0), w.k, x, x_stride, yj, w.n, m, cols, w,
                   next);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// bfloat16 dot products (vdpbf16ps: 32 products into 16 fp32 sums, where an FMA makes 16): for
// many rows of x against quantized weights, which are rounded already. Both operands hold pairs
// of consecutive k in each 32-bit lane: a weight lane is (w[2p, c], w[2p + 1, c]).

// A quantized panel as bf16 pairs: out[p * 32 + c] = (w[2p, c], w[2p + 1, c]).
template <Format F>
void dequant_panel_bf16(const Panels& w, int64_t j, uint32_t* out) {
  PanelReader<F> panel(w, j);
  for (int64_t g = 0; g < w.groups(); ++g) {
    panel.start_group(g);
    for (int64_t t = g * kGroup; t < (g + 1) * kGroup; t += 2) {
      __m512 lo0, hi0, lo1, hi1;
      panel.load(t, lo0, hi0);
      panel.load(t + 1, lo1, hi1);
      _mm512_storeu_si512(out + t / 2 * kPanel, bf16_pairs(lo0, lo1));
      _mm512_storeu_si512(out + t / 2 * kPanel + 16, bf16_pairs(hi0, hi1));
    }
  }
}

// y[0 .. MR, 0 .. cols) for one panel of bf16 pairs p against MR rows of x as bf16 pairs: row i
// at x + i * x_stride, or (Tiled) the tile's rows as x_tiles lays them out, pair t of row i at
// x[t * MR + i]. Each output is one chain of dot products over k, in order, whatever MR and the
// layout are. Stream: the panel comes from memory (asked for ahead of its use) rather than from
// a scratch panel in L2.
template <int MR, bool Stream, bool Tiled>
void bf16_tile(const uint32_t* p, int64_t k, const uint32_t* x, int64_t x_stride, float* y,
               int64_t y_stride, int cols) {
  __m512 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < k / 2; ++t) {
    if constexpr (Stream) request(p + (t + kF32Ahead / 2) * kPanel, kPanel * 4);
    const __m512bh w_lo = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p + t * kPanel));
    const __m512bh w_hi = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p + t * kPanel + 16));
    for (int i = 0; i < MR; ++i) {
      const uint32_t pair = Tiled ? x[t * MR + i] : x[i * x_stride + t];
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      lo[i] = _mm512_dpbf16_ps(lo[i], xv, w_lo);
      hi[i] = _mm512_dpbf16_ps(hi[i], xv, w_hi);
    }
  }
  for (int i = 0; i < MR; ++i) store(y + i * y_stride, lo[i], hi[i], cols);
}

// x[0 .. 32) as 16 bf16 pairs (rounded to nearest even): pair t is (x[2t], x[2t + 1]).
inline __m512i pairs_of(const float* x) {
  return reinterpret_cast<__m512i>(
      _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)));
}

// Rows of x as bf16 pairs (pairs_of): row i's pair t is (x[i, 2t], x[i, 2t + 1]). Rows from m up
// to padded_rows are zeros (AMX tiles load 16 rows at a time).
std::unique_ptr<uint32_t[]> x_pairs(const float* x, int64_t x_stride, int64_t m, int64_t k,
                                    int64_t padded_rows = 0) {
  const int64_t pairs = k / 2;
  auto xb = scratch_of<uint32_t>(std::max(m, padded_rows) * pairs);
  if (padded_rows > m) std::memset(xb.get() + m * pairs, 0, (padded_rows - m) * pairs * 4);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t t = 0; t < k; t += kGroup)
        _mm512_storeu_si512(xb.get() + i * pairs + t / 2, pairs_of(x + i * x_stride + t));
  });
  return xb;
}

// Rows of x as bf16 pairs, tile by tile as for_each_tile(m) splits them, for bf16_tile: the tile
// of R rows at m0 starts at m0 * k / 2 and holds pair t of its row i at t * R + i, so that a step
// of k reads the tile's R pairs side by side, where rows one after another had it read R
// streams a row's length apart (SmolLM2's matmuls at 96-512 rows: 3-7 % faster, timed in one
// process against the row layout with loadtest.kernel_ab). Each 32 values of x of 16 rows are
// rounded to pairs, transposed in registers and stored a pair of the rows at a time.
std::unique_ptr<uint32_t[]> x_tiles(const float* x, int64_t x_stride, int64_t m, int64_t k) {
  const int64_t pairs = k / 2;
  auto xb = scratch_of<uint32_t>(m * pairs);
  std::vector<std::pair<int64_t, int>> tiles;  // (m0, rows)
  for_each_tile(m, [&]<int R>(int64_t m0) { tiles.emplace_back(m0, R); });
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 2, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const auto [m0, rows] = tiles[s];
      float* out = reinterpret_cast<float*>(xb.get() + m0 * pairs);
      const __mmask16 lanes = static_cast<__mmask16>((1u << rows) - 1);
      for (int64_t t = 0; t < k; t += kGroup) {
        __m512 row_pairs[16], step_pairs[16];  // 16 pairs of each row; each pair of the rows
        for (int i = 0; i < 16; ++i)
          row_pairs[i] = i < rows ? _mm512_castsi512_ps(pairs_of(x + (m0 + i) * x_stride + t))
                                  : _mm512_setzero_ps();
        paged::transpose16(row_pairs, 1, step_pairs);
        for (int c = 0; c < 16; ++c)
          _mm512_mask_storeu_ps(out + (t / 2 + c) * rows, lanes, step_pairs[c]);
      }
    }
  });
  return xb;
}

// From this many rows x is laid out tile by tile for bf16_tile (x_tiles). Below it the layout
// did not pay for its pass over x (13-24 rows: 0.97-1.08x the time; 64 rows 0.99-1.03x), from it
// it did (96 rows 0.95-0.97x, 128 rows 0.96-0.99x).
constexpr int64_t kTiledRows = 96;

// x's m rows as bf16 pairs for bf16_tile: tile by tile (x_tiles) from kTiledRows, else row by
// row (x_pairs).
struct PairedRows {
  bool tiled;
  std::unique_ptr<uint32_t[]> pairs;
  int64_t row_pairs;  // k / 2

  PairedRows(const float* x, int64_t x_stride, int64_t m, int64_t k)
      : tiled(m >= kTiledRows),
        pairs(tiled ? x_tiles(x, x_stride, m, k) : x_pairs(x, x_stride, m, k)),
        row_pairs(k / 2) {}

  // bf16_tile over the R rows from m0.
  template <int R, bool Stream>
  void tile(int64_t m0, const uint32_t* p, int64_t k, float* y, int64_t y_stride,
            int cols) const {
    const uint32_t* rows = pairs.get() + m0 * row_pairs;
    if (tiled) bf16_tile<R, Stream, true>(p, k, rows, row_pairs, y, y_stride, cols);
    else bf16_tile<R, Stream, false>(p, k, rows, row_pairs, y, y_stride, cols);
  }
};

template <Format F>
void panels_run_bf16(const Panels& w, const float* x, int64_t x_stride, float* y, int64_t m) {
  const int64_t pairs = w.k / 2;
  const PairedRows xb(x, x_stride, m, w.k);
  at::parallel_for(0, w.num_panels, 1, [&](int64_t begin, int64_t end) {
    const auto scratch = scratch_of<uint32_t>(pairs * kPanel);
    for (int64_t j = begin; j < end; ++j) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, w.n - j * kPanel));
      dequant_panel_bf16<F>(w, j, scratch.get());
      for_each_tile(m, [&]<int R>(int64_t m0) {
        xb.tile<R, false>(m0, scratch.get(), w.k, y + m0 * w.n + j * kPanel, w.n, cols);
      });
    }
  });
}
constexpr bool kBf16Dot = true;

// A bf16 model's weights, packed as pairs ([N/32, K/2, 32] bf16 pairs, as dequant_panel_bf16
// makes them), against x rounded to bf16: every row count takes the same dot products, so a
// row's outputs are the same bits whatever shares its step (one decode or a 512-row prefill).
// Few rows stream the panels from memory; more take x a block at a time (kBf16BlockBytes).
void pairs_run(const uint32_t* w, int64_t num_panels, int64_t k, int64_t n, const float* x,
               int64_t x_stride, float* y, int64_t m) {
  const int64_t pairs = k / 2;
  const PairedRows xb(x, x_stride, m, k);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - j * kPanel));
      for_each_tile(m, [&]<int R>(int64_t m0) {
        xb.tile<R, true>(m0, w + j * pairs * kPanel, k, y + m0 * n + j * kPanel, n, cols);
      });
    }
  });
}

// The same pairs on AMX tiles (amx_tiles.h: the instructions, or their software model), where
// the CPU has them and `model.amx` asks for them, at every row count. A step multiplies 32 rows
// of x (two A tiles) by a panel's 32 columns (two B tiles, read from the pairs as they are
// packed: 16 pairs of rows of k, 64 bytes of each 128-byte row) into four 16 x 16 fp32 tiles,
// 32 values of k at a time.
// Each output is the same sums in the same order whatever the row count: batch-invariant, as
// the vdpbf16ps path is, but not with its bits (tdpbf16ps orders its sums otherwise). Rows of x
// past m are zeros (x_pairs pads them); partial tiles are stored into a spill tile first. The
// first 32 rows stream the panel from memory, asked for ahead of its use as pairs_run does; the
// rest find it in L2.
template <class Tiles, bool Two>
void tile_rows(const uint32_t* p, int64_t pairs, const uint32_t* x, float* y, int64_t y_stride,
               int rows, int cols, bool stream) {
  Tiles::template zero<0>();
  Tiles::template zero<1>();
  if constexpr (Two) {
    Tiles::template zero<2>();
    Tiles::template zero<3>();
  }
  const int64_t x_bytes = pairs * 4;
  for (int64_t t = 0; t < pairs; t += 16) {
    if (stream) request(p + (t + kF32Ahead / 2) * kPanel, 16 * kPanel * 4);
    Tiles::template load<6>(p + t * kPanel, kPanel * 4);
    Tiles::template load<7>(p + t * kPanel + 16, kPanel * 4);
    Tiles::template load<4>(x + t, x_bytes);
    Tiles::template dot<0, 4, 6>();
    Tiles::template dot<1, 4, 7>();
    if constexpr (Two) {
      Tiles::template load<5>(x + 16 * pairs + t, x_bytes);
      Tiles::template dot<2, 5, 6>();
      Tiles::template dot<3, 5, 7>();
    }
  }
  if (rows == (Two ? 32 : 16) && cols == kPanel) {
    Tiles::template store<0>(y, y_stride * 4);
    Tiles::template store<1>(y + 16, y_stride * 4);
    if constexpr (Two) {
      Tiles::template store<2>(y + 16 * y_stride, y_stride * 4);
      Tiles::template store<3>(y + 16 * y_stride + 16, y_stride * 4);
    }
    return;
  }
  alignas(64) float spill[32][kPanel];
  Tiles::template store<0>(spill[0], kPanel * 4);
  Tiles::template store<1>(spill[0] + 16, kPanel * 4);
  if constexpr (Two) {
    Tiles::template store<2>(spill[16], kPanel * 4);
    Tiles::template store<3>(spill[16] + 16, kPanel * 4);
  }
  for (int i = 0; i < rows; ++i) std::memcpy(y + i * y_stride, spill[i], cols * 4);
}

template <class Tiles>
void tiles_run(const uint32_t* w, int64_t num_panels, int64_t k, int64_t n, const float* x,
               int64_t x_stride, float* y, int64_t m) {
  const int64_t pairs = k / 2;
  const auto xb = x_pairs(x, x_stride, m, k, (m + 15) / 16 * 16);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    Tiles::template configure<amx::Layout::Bf16>();
    for (int64_t j = begin; j < end; ++j) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - j * kPanel));
      const uint32_t* p = w + j * pairs * kPanel;
      for (int64_t m0 = 0; m0 < m; m0 += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, m - m0));
        if (rows > 16)
          tile_rows<Tiles, true>(p, pairs, xb.get() + m0 * pairs, y + m0 * n + j * kPanel, n,
                                 rows, cols, m0 == 0);
        else
          tile_rows<Tiles, false>(p, pairs, xb.get() + m0 * pairs, y + m0 * n + j * kPanel, n,
                                  rows, cols, m0 == 0);
      }
    }
    Tiles::release();
  });
}
#else
template <Format F>
void panels_run_bf16(const Panels& w, const float* x, int64_t x_stride, float* y, int64_t m) {
  panels_run<F>(w, x, x_stride, y, m);
}
constexpr bool kBf16Dot = false;
#endif

// Past this many rows, x in fp32 FMAs is taken a block of rows at a time, so that the block
// stays in L2 while every panel passes over it (512 rows of K = 1536 are 3 MB: each panel's pass
// would wait on L3). A panel is then read once per block; a quantized one dequantized once per
// block. bf16 dot products take larger blocks (below).
constexpr int64_t kRowBlock = 96;
// In bf16 dot products, x (as bf16 pairs) is read from L3 for every panel: one byte per 32
// flops, which keeps up, and a panel is paired once per block, so blocks are as large as keep x
// within this many bytes, in L3 beside the other cores' (512 rows, SmolLM2's thirty layers:
// 327 ms in blocks of 96 rows, 299 ms in one, both on one Zen 4).
constexpr int64_t kBf16BlockBytes = 4 << 20;

// Rows of bf16 dot products a block takes: x (as pairs) within kBf16BlockBytes.
inline int64_t bf16_block_rows(int64_t k) { return std::max(kRowBlock, kBf16BlockBytes / (2 * k)); }

// fn(m0, rows) for blocks of at most max_rows of [0, m), as even as they can be, in whole
// register tiles.
template <typename Fn>
void for_each_row_block(int64_t m, int64_t max_rows, const Fn& fn) {
  if (m == 0) return;
  const int64_t blocks = (m + max_rows - 1) / max_rows;
  const int64_t rows = ((m + blocks - 1) / blocks + kPanelRows - 1) / kPanelRows * kPanelRows;
  for (int64_t m0 = 0; m0 < m; m0 += rows) fn(m0, std::min(rows, m - m0));
}

// bf16: rows past kScratchRows against quantized weights may multiply in bfloat16.
void panels_matmul(const Panels& w, const float* x, int64_t x_stride, float* y, int64_t m,
                   bool bf16) {
  bf16 = bf16 && m > kScratchRows;
  using Run = void (*)(const Panels&, const float*, int64_t, float*, int64_t);
  Run run = panels_run<Format::F32>;
  if (w.format == Format::BF16)
    run = bf16 ? panels_run_bf16<Format::BF16> : panels_run<Format::BF16>;
  else if (w.format == Format::Int8)
    run = bf16 ? panels_run_bf16<Format::Int8> : panels_run<Format::Int8>;
  else if (w.format == Format::Int4)
    run = bf16 ? panels_run_bf16<Format::Int4> : panels_run<Format::Int4>;
  for_each_row_block(m, bf16 ? bf16_block_rows(w.k) : kRowBlock, [&](int64_t m0, int64_t rows) {
    run(w, x + m0 * x_stride, x_stride, y + m0 * w.n, rows);
  });
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 and FMA without AVX-512 (Zen 2 and 3, Haswell to Alder Lake), 16 vector registers of 8
// fp32. One or two rows (decode) take the whole panel in one tile (8 accumulators; a single row
// two steps of k at a time, so that 8 FMA chains are in flight), the panel's four vectors of a
// step loaded once for both rows and asked for ahead of their use. More rows take half a panel
// (16 columns) in tiles of up to 6 rows: 12 accumulators, and each step of k loads the half's 2
// vectors and broadcasts 6 of x for 12 FMAs; the tiles after the first read the panel again
// from L2 (a SmolLM2 panel is 72-192 KB). Those tiles are too short to ask for a panel from
// memory ahead of their own use, so every tile asks for a share of the next panel instead
// (Ahead). fp32 panels are read where they lie; the other formats are dequantized into an fp32
// scratch panel first, once a panel per call (per block of rows past kRowBlock).
constexpr bool kBf16Dot = false;
constexpr int64_t kWholeRows = 2;  // up to this many rows, whole-panel tiles; past it, half-panel
// Rows of x a block, as on AVX-512, so that a block stays in L2 across panels where the rows are
// short enough (96 of SmolLM2's K = 576 are 221 KB; of K = 1536, 590 KB: L3 on a 256 KB L2).
constexpr int64_t kRowBlock = 96;
constexpr int64_t kF32Ahead = 64;  // steps of k a panel is asked for ahead of its use
constexpr int64_t kGroupsAhead = 8;  // int8, int4: groups of 32 steps

// The first cols (at most 8; none if cols <= 0) of v.
inline void store8(float* y, __m256 v, int cols) {
  if (cols >= 8) {
    _mm256_storeu_ps(y, v);
  } else if (cols > 0) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    std::copy(lanes, lanes + cols, y);
  }
}

// Panel j's weights as fp32, a step of k (its 32 columns, four vectors) at a time, dequantized
// in registers; its own stream asked for ahead of its use. Reads past the panel's end are only
// ever prefetch hints, which never fault.
template <Format F>
struct StepReader {
  const float* f = nullptr;
  const uint16_t* b = nullptr;
  const int8_t* q8 = nullptr;
  const uint8_t* q4 = nullptr;
  const float* s = nullptr;
  const float* mn = nullptr;
  __m256 scale[4] = {}, low[4] = {};  // int8 and int4: group g's (int4: low, its mins)

  StepReader(const Panels& w, int64_t j) {
    if constexpr (F == Format::F32) f = w.f32 + j * w.k * kPanel;
    if constexpr (F == Format::BF16) b = w.b16 + j * w.k * kPanel;
    if constexpr (F == Format::Int8 || F == Format::Int4) s = w.scale + j * w.groups() * kPanel;
    if constexpr (F == Format::Int8) q8 = w.q8 + j * w.k * kPanel;
    if constexpr (F == Format::Int4) {
      q4 = w.q4 + j * w.k * (kPanel / 2);
      mn = w.min + j * w.groups() * kPanel;
    }
  }

  // Group g's scales (and mins) into registers, and group g + kGroupsAhead asked for.
  inline void start_group(int64_t g) {
    if constexpr (F == Format::Int8 || F == Format::Int4) {
      const int64_t ahead = g + kGroupsAhead;
      request(s + ahead * kPanel, kPanel * 4);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) scale[v] = _mm256_loadu_ps(s + g * kPanel + 8 * v);
      if constexpr (F == Format::Int8) request(q8 + ahead * kGroup * kPanel, kGroup * kPanel);
      if constexpr (F == Format::Int4) {
        request(q4 + ahead * kGroup * (kPanel / 2), kGroup * kPanel / 2);
        request(mn + ahead * kPanel, kPanel * 4);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) low[v] = _mm256_loadu_ps(mn + g * kPanel + 8 * v);
      }
    }
  }

  inline void load(int64_t t, __m256 out[4]) const {
    if constexpr (F == Format::F32) {
      const float* soon = f + (t + kF32Ahead) * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(soon), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(soon + 16), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) out[v] = _mm256_loadu_ps(f + t * kPanel + 8 * v);
    } else if constexpr (F == Format::BF16) {  // a bf16 is the high half of an fp32
      _mm_prefetch(reinterpret_cast<const char*>(b + (t + kF32Ahead) * kPanel), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + t * kPanel + 8 * v));
        out[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
    } else if constexpr (F == Format::Int8) {
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q8 + t * kPanel + 8 * v));
        out[v] = _mm256_mul_ps(scale[v], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
      }
    } else {  // byte c: column c in its low nibble, c + 16 in its high one
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        const __m256i q = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q4 + t * (kPanel / 2) + 8 * v)));
        out[v] = _mm256_fmadd_ps(
            scale[v], _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0xF))), low[v]);
        out[v + 2] = _mm256_fmadd_ps(scale[v + 2], _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)),
                                     low[v + 2]);
      }
    }
  }
};

// Panel j of a bf16, int8 or int4 W dequantized into out [K, 32] (fp32), for tiles of more rows.
template <Format F>
void dequant_avx2(const Panels& w, int64_t j, float* out) {
  StepReader<F> panel(w, j);
  for (int64_t t = 0; t < w.k; ++t) {
    if (t % kGroup == 0) panel.start_group(t / kGroup);
    __m256 v[4];
    panel.load(t, v);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + t * kPanel + 8 * i, v[i]);
  }
}

// y[0 .. MR, 0 .. cols) = x[0 .. MR, :] w^T for a whole panel, MR 1 or 2, the weights read and
// dequantized once for both rows.
template <Format F, int MR>
void whole_panel_tile(StepReader<F> w, int64_t k, const float* x, int64_t x_stride, float* y,
                      int64_t y_stride, int cols) {
  // (Every loop but k's unrolled, as in half_panel_tile below.)
  constexpr int kSteps = MR == 1 ? 2 : 1;  // steps of k a pass: 8 accumulators either way
  __m256 acc[kSteps][MR][4];
#pragma GCC unroll 8
  for (int u = 0; u < kSteps; ++u)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < 4; ++v) acc[u][i][v] = _mm256_setzero_ps();
  // Groups of 32 start on even steps, so a pass of two steps never straddles two groups.
  const int64_t whole = k / kSteps * kSteps;
  for (int64_t t = 0; t < whole; t += kSteps) {
    if (t % kGroup == 0) w.start_group(t / kGroup);
#pragma GCC unroll 8
    for (int u = 0; u < kSteps; ++u) {
      __m256 wv[4];
      w.load(t + u, wv);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * x_stride + t + u);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[u][i][v] = _mm256_fmadd_ps(xv, wv[v], acc[u][i][v]);
      }
    }
  }
  if (whole < k) {  // one step left over (fp32, a single row, K odd)
    __m256 wv[4];
    w.load(whole, wv);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * x_stride + whole);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[0][i][v] = _mm256_fmadd_ps(xv, wv[v], acc[0][i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < 4; ++v) {
      __m256 sum = acc[0][i][v];
      if constexpr (kSteps == 2) sum = _mm256_add_ps(sum, acc[1][i][v]);
      store8(y + i * y_stride + 8 * v, sum, cols - 8 * v);
    }
}

// y[0 .. MR, 0 .. cols) = x[0 .. MR, :] h^T for half a panel h (16 of its columns, rows 32
// apart), cols at most 16.
template <int MR>
void half_panel_tile(const float* h, int64_t k, const float* x, int64_t x_stride, float* y,
                     int64_t y_stride, int cols, Ahead ahead) {
  // (Every loop over the rows unrolled: else GCC stores the accumulators to the stack after
  // every step of k.)
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < k; t0 += ahead.every) {
    ahead.next();
    const int64_t t1 = std::min(k, t0 + ahead.every);
    for (int64_t t = t0; t < t1; ++t) {
      const __m256 w0 = _mm256_loadu_ps(h + t * kPanel), w1 = _mm256_loadu_ps(h + t * kPanel + 8);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * x_stride + t);
        lo[i] = _mm256_fmadd_ps(xv, w0, lo[i]);
        hi[i] = _mm256_fmadd_ps(xv, w1, hi[i]);
      }
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    store8(y + i * y_stride, lo[i], cols);
    store8(y + i * y_stride + 8, hi[i], cols - 8);
  }
}

// Rows of x (3 or more) against one fp32 panel p [K, 32] (panel j's weights, or its dequantized
// copy) in half-panel tiles, while panel `next`'s stream (none if -1) is asked for.
void half_panel_rows(const float* p, const Panels& w, int64_t next, const float* x,
                     int64_t x_stride, float* y, int64_t y_stride, int64_t m, int cols) {
  // Tiles of 6 rows, the last ones as even as they can be (13 rows: 6 + 7 -> 4 + 4 + 5).
  const int64_t tiles = (m + 5) / 6;
  const int halves = cols > 16 ? 2 : 1;
  for (int half = 0; half < halves; ++half) {
    const int half_cols = std::min(cols - 16 * half, 16);
    int64_t i0 = 0;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t rows = (m - i0) / (tiles - tile);
      const float* h = p + 16 * half;
      const float* xi = x + i0 * x_stride;
      float* yi = y + i0 * y_stride + 16 * half;
      const Ahead a = next < 0 ? Ahead{} : Ahead::share(w, next, half * tiles + tile,
                                                         halves * tiles);
      const int64_t k = w.k;
      switch (rows) {
        case 1: half_panel_tile<1>(h, k, xi, x_stride, yi, y_stride, half_cols, a); break;
        case 2: half_panel_tile<2>(h, k, xi, x_stride, yi, y_stride, half_cols, a); break;
        case 3: half_panel_tile<3>(h, k, xi, x_stride, yi, y_stride, half_cols, a); break;
        case 4: half_panel_tile<4>(h, k, xi, x_stride, yi, y_stride, half_cols, a); break;
        case 5: half_panel_tile<5>(h, k, xi, x_stride, yi, y_stride, half_cols, a); break;
        default: half_panel_tile<6>(h, k, xi, x_stride, yi, y_stride, half_cols, a); break;
      }
      i0 += rows;
    }
  }
}

template <Format F>
void panels_run(const Panels& w, const float* x, int64_t x_stride, float* y, int64_t m) {
  at::parallel_for(0, w.num_panels, 1, [&](int64_t begin, int64_t end) {
    const bool dequantized = F != Format::F32 && m > kWholeRows;
    const auto scratch = scratch_of<float>(dequantized ? w.k * kPanel : 0);
    for (int64_t j = begin; j < end; ++j) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, w.n - j * kPanel));
      const int64_t next = j + 1 < end ? j + 1 : -1;  // this thread's next panel
      float* yj = y + j * kPanel;
      if (m <= kWholeRows) {  // one tile, which asks for the panel's stream itself
        const StepReader<F> r(w, j);
        if (m == 1)
          whole_panel_tile<F, 1>(r, w.k, x, x_stride, yj, w.n, cols);
        else
          whole_panel_tile<F, 2>(r, w.k, x, x_stride, yj, w.n, cols);
        continue;
      }
      if constexpr (F != Format::F32)
        if (dequantized) dequant_avx2<F>(w, j, scratch.get());
      const float* p = dequantized ? scratch.get() : w.f32 + j * w.k * kPanel;
      half_panel_rows(p, w, next, x, x_stride, yj, w.n, m, cols);
    }
  });
}

void panels_matmul(const Panels& w, const float* x, int64_t x_stride, float* y, int64_t m, bool) {
  if (m == 0) return;
  TORCH_CHECK(w.format != Format::W8A8 && w.format != Format::W4A8,
              "panels_matmul: quads multiply on quads_matmul");
  using Run = void (*)(const Panels&, const float*, int64_t, float*, int64_t);
  const Run run = w.format == Format::BF16   ? panels_run<Format::BF16>
                  : w.format == Format::Int8 ? panels_run<Format::Int8>
                  : w.format == Format::Int4 ? panels_run<Format::Int4>
                                             : panels_run<Format::F32>;
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t block_rows = (m + blocks - 1) / blocks;
  for (int64_t m0 = 0; m0 < m; m0 += block_rows)
    run(w, x + m0 * x_stride, x_stride, y + m0 * w.n, std::min(block_rows, m - m0));
}
#else
// Portable path (no AVX2): each panel dequantized into a scratch panel, then plain loops the
// compiler vectorizes.
constexpr bool kBf16Dot = false;
void panels_matmul(const Panels& w, const float* x, int64_t x_stride, float* y, int64_t m, bool) {
  at::parallel_for(0, w.num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(w.k * kPanel);
    for (int64_t j = begin; j < end; ++j) {
      w.dequant(j, panel.data());
      const int64_t cols = std::min<int64_t>(kPanel, w.n - j * kPanel);
      for (int64_t i = 0; i < m; ++i) {
        float acc[kPanel] = {};
        for (int64_t t = 0; t < w.k; ++t) {
          const float xv = x[i * x_stride + t];
          for (int c = 0; c < kPanel; ++c) acc[c] += xv * panel[t * kPanel + c];
        }
        std::copy(acc, acc + cols, y + i * w.n + j * kPanel);
      }
    }
  });
}
#endif

// x [m, K] quantized per row and group of 32 for the int8 dot products (quantize_rows, below, per
// instruction set): the codes u (and with the second bytes v) as Code, per group its scale (and
// the second bytes'), its low and its sum.
// padded: the codes run 16 rows of zeros past m (AMX tiles load 16 rows at a time).
template <typename Code>
struct CodedRows {
  int64_t k, groups;
  std::vector<Code> u, v;
  std::vector<float> scale, rscale, low, xsum;
  CodedRows(int64_t m, int64_t k, bool precise, bool padded)
      : k(k), groups(k / kGroup), u((m + (padded ? 16 : 0)) * k),
        v(precise ? (m + (padded ? 16 : 0)) * k : 0), scale(m * groups),
        rscale(precise ? m * groups : 0), low(m * groups), xsum(m * groups) {}
};

// Where int8 activations multiply: the VNNI (or AVX2) tiles, AMX-INT8 tiles, or their software
// model (amx_tiles.h).
enum class QuadUnits { Vector, AmxTiles, AmxModel };

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kInt8Dot = true;
constexpr int64_t kQuadsPerGroup = kGroup / 4;

// x [m, K] quantized per row and group of 32: x ~ scale * u + low, u in 0..255. Precise: plus
// the remainder in a second byte, x ~ scale * u + rscale * v + low with v in 1..255 (the
// remainder over rscale = scale / 254, + 128; low takes the 128 back out): about 16 bits of
// the group's range, for twice the dot products. xsum: scale * sum(u) [+ rscale * sum(v)], for
// w4a8's min.
using QuantizedRows = CodedRows<uint8_t>;

QuantizedRows quantize_rows(const float* x, int64_t x_stride, int64_t m, int64_t k, bool precise,
                            bool padded) {
  const int64_t groups = k / kGroup;
  QuantizedRows r(m, k, precise, padded);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    const __m512i cap = _mm512_set1_epi32(255);
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = i * groups + g;
        const float* xg = x + i * x_stride + g * kGroup;
        const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
        float low = _mm512_reduce_min_ps(_mm512_min_ps(a, b));
        float high = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
        // min / max pass a NaN over: a NaN anywhere in the group makes its scale and low NaN,
        // so the output is NaN, as an fp32 product's would be.
        if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q))
          low = high = std::numeric_limits<float>::quiet_NaN();
        // A constant group is exact: scale 0, every u 0, x = low.
        const float inverse = high > low ? 255.0f / (high - low) : 0.0f;  // 0 for NaN too
        const float scale = high > low ? (high - low) / 255.0f : high - low;
        const __m512 lo = _mm512_set1_ps(low), inv = _mm512_set1_ps(inverse);
        // Rounded to nearest (even), as every fp32 -> int32 conversion here is; clamped in case
        // the rounding of (x - low) * inverse passes 255.
        // (Unsigned: a failed conversion, inf, is 0x80000000 and becomes 255, as it is stored.)
        const __m512i ua = _mm512_min_epu32(
            _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(a, lo), inv)), cap);
        const __m512i ub = _mm512_min_epu32(
            _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(b, lo), inv)), cap);
        uint8_t* out = r.u.data() + i * k + g * kGroup;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtusepi32_epi8(ua));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtusepi32_epi8(ub));
        r.scale[at] = scale;
        float xsum = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ua, ub)));
        if (precise) {
          // What u left over, within half a step either way, in 254 steps of scale / 254.
          const float rscale = scale / 254.0f;
          const __m512 s = _mm512_set1_ps(scale), rinv = _mm512_set1_ps(high > low ? 254.0f / scale : 0.0f);
          const __m512 rest_a = _mm512_sub_ps(_mm512_sub_ps(a, lo), _mm512_mul_ps(_mm512_cvtepi32_ps(ua), s));
          const __m512 rest_b = _mm512_sub_ps(_mm512_sub_ps(b, lo), _mm512_mul_ps(_mm512_cvtepi32_ps(ub), s));
          const __m512i bias = _mm512_set1_epi32(128), one = _mm512_set1_epi32(1);
          const __m512i va = _mm512_max_epi32(_mm512_min_epi32(_mm512_add_epi32(
              _mm512_cvtps_epi32(_mm512_mul_ps(rest_a, rinv)), bias), cap), one);
          const __m512i vb = _mm512_max_epi32(_mm512_min_epi32(_mm512_add_epi32(
              _mm512_cvtps_epi32(_mm512_mul_ps(rest_b, rinv)), bias), cap), one);
          uint8_t* rest = r.v.data() + i * k + g * kGroup;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(rest), _mm512_cvtusepi32_epi8(va));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(rest + 16), _mm512_cvtusepi32_epi8(vb));
          r.rscale[at] = rscale;
          low -= 128.0f * rscale;
          xsum += rscale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(va, vb)));
        }
        r.low[at] = low;
        r.xsum[at] = xsum;
      }
  });
  return r;
}

// A group's end for one row of x against a panel's 32 columns, from its int32 sums (of the
// first bytes, and with the second bytes of the rest): lo, hi += scale_w * (sx * sum(q u) [+ rx *
// sum(q v)]) [+ min * xsum] + low * sum(w), at = the row's group. s, ws: the group's weight scales
// and sums; mins (W4A8) its mins. The VNNI and the AMX tiles share it, so that their outputs have
// the same bits (their int32 sums are exact either way).
template <Format F, bool Precise>
__attribute__((always_inline)) inline void end_group(
    const QuantizedRows& x, int64_t at, __m512i sum_lo, __m512i sum_hi, __m512i rest_lo,
    __m512i rest_hi, __m512 s_lo, __m512 s_hi, __m512 ws_lo, __m512 ws_hi, const float* mins,
    __m512& lo, __m512& hi) {
  const __m512 sx = _mm512_set1_ps(x.scale[at]);
  __m512 d_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(sum_lo), sx);
  __m512 d_hi = _mm512_mul_ps(_mm512_cvtepi32_ps(sum_hi), sx);
  if constexpr (Precise) {
    const __m512 rx = _mm512_set1_ps(x.rscale[at]);
    d_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest_lo), rx, d_lo);
    d_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest_hi), rx, d_hi);
  }
  // Each step's value pinned: -ffast-math would leave the compiler free to contract and
  // reorder these differently in each caller, and the two tiles' bits would differ.
  __asm__("" : "+v"(d_lo), "+v"(d_hi));
  d_lo = _mm512_mul_ps(d_lo, s_lo);
  d_hi = _mm512_mul_ps(d_hi, s_hi);
  __asm__("" : "+v"(d_lo), "+v"(d_hi));
  if constexpr (F == Format::W4A8) {
    const __m512 xsum = _mm512_set1_ps(x.xsum[at]);
    d_lo = _mm512_fmadd_ps(_mm512_loadu_ps(mins), xsum, d_lo);
    d_hi = _mm512_fmadd_ps(_mm512_loadu_ps(mins + 16), xsum, d_hi);
    __asm__("" : "+v"(d_lo), "+v"(d_hi));
  }
  const __m512 low = _mm512_set1_ps(x.low[at]);
  d_lo = _mm512_add_ps(d_lo, lo);
  d_hi = _mm512_add_ps(d_hi, hi);
  __asm__("" : "+v"(d_lo), "+v"(d_hi));
  lo = _mm512_fmadd_ps(ws_lo, low, d_lo);
  hi = _mm512_fmadd_ps(ws_hi, low, d_hi);
}

// y[r0 .. r0 + MR, 0 .. cols) for panel j, F W8A8 or W4A8; Precise: x's second bytes too.
template <Format F, int MR, bool Precise>
void quad_tile(const Panels& w, int64_t j, const QuantizedRows& x, int64_t r0, float* y,
               int64_t y_stride, int cols) {
  constexpr int64_t kQuadBytes = F == Format::W8A8 ? 4 * kPanel : 2 * kPanel;
  const uint8_t* q = (F == Format::W8A8 ? reinterpret_cast<const uint8_t*>(w.q8) : w.q4) +
                     j * (w.k / 4) * kQuadBytes;
  const float* s = w.scale + j * w.groups() * kPanel;
  const float* sums = w.sums + j * w.groups() * kPanel;
  const float* mins = F == Format::W4A8 ? w.min + j * w.groups() * kPanel : nullptr;
  const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  __m512 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups(); ++g) {
    const uint8_t* qg = q + g * kQuadsPerGroup * kQuadBytes;
    request(qg + kGroupsAhead * kQuadsPerGroup * kQuadBytes, kQuadsPerGroup * kQuadBytes);
    request(s + (g + kGroupsAhead) * kPanel, kPanel * 4);
    request(sums + (g + kGroupsAhead) * kPanel, kPanel * 4);
    if constexpr (F == Format::W4A8) request(mins + (g + kGroupsAhead) * kPanel, kPanel * 4);
    __m512i sum_lo[MR], sum_hi[MR], rest_lo[Precise ? MR : 1], rest_hi[Precise ? MR : 1];
    for (int i = 0; i < MR; ++i) sum_lo[i] = sum_hi[i] = _mm512_setzero_si512();
    if constexpr (Precise)
      for (int i = 0; i < MR; ++i) rest_lo[i] = rest_hi[i] = _mm512_setzero_si512();
    const int64_t x_at = r0 * x.k + g * kGroup;
    for (int64_t v = 0; v < kQuadsPerGroup; ++v) {
      __m512i w_lo, w_hi;
      if constexpr (F == Format::W8A8) {
        w_lo = _mm512_loadu_si512(qg + v * kQuadBytes);
        w_hi = _mm512_loadu_si512(qg + v * kQuadBytes + 64);
      } else {
        const __m512i bytes = _mm512_loadu_si512(qg + v * kQuadBytes);
        w_lo = _mm512_sub_epi8(_mm512_and_si512(bytes, nibble), eight);
        w_hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble), eight);
      }
      for (int i = 0; i < MR; ++i) {
        int32_t quad;
        std::memcpy(&quad, x.u.data() + x_at + i * x.k + v * 4, sizeof quad);
        const __m512i xv = _mm512_set1_epi32(quad);
        sum_lo[i] = _mm512_dpbusd_epi32(sum_lo[i], xv, w_lo);
        sum_hi[i] = _mm512_dpbusd_epi32(sum_hi[i], xv, w_hi);
        if constexpr (Precise) {
          std::memcpy(&quad, x.v.data() + x_at + i * x.k + v * 4, sizeof quad);
          const __m512i rv = _mm512_set1_epi32(quad);
          rest_lo[i] = _mm512_dpbusd_epi32(rest_lo[i], rv, w_lo);
          rest_hi[i] = _mm512_dpbusd_epi32(rest_hi[i], rv, w_hi);
        }
      }
    }
    const __m512 s_lo = _mm512_loadu_ps(s + g * kPanel), s_hi = _mm512_loadu_ps(s + g * kPanel + 16);
    const __m512 ws_lo = _mm512_loadu_ps(sums + g * kPanel);
    const __m512 ws_hi = _mm512_loadu_ps(sums + g * kPanel + 16);
    for (int i = 0; i < MR; ++i)
      end_group<F, Precise>(x, (r0 + i) * x.groups + g, sum_lo[i], sum_hi[i],
                            rest_lo[Precise ? i : 0], rest_hi[Precise ? i : 0], s_lo, s_hi, ws_lo,
                            ws_hi, F == Format::W4A8 ? mins + g * kPanel : nullptr, lo[i], hi[i]);
  }
  for (int i = 0; i < MR; ++i) store(y + i * y_stride, lo[i], hi[i], cols);
}

template <Format F, bool Precise>
void quads_run(const Panels& w, const QuantizedRows& x, float* y, int64_t r0, int64_t m) {
  // Tiles of 6 rows of 4 accumulators (int32 and fp32, 2 of each); with the second bytes, 4
  // rows of 6 (4 int32, 2 fp32).
  constexpr int kRows = Precise ? 4 : 6;
  static_assert(kPanelRows % kRows == 0, "row blocks are whole tiles of either height");
  at::parallel_for(0, w.num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, w.n - j * kPanel));
      for_each_tile<kRows>(m, [&]<int R>(int64_t m0) {
        quad_tile<F, R, Precise>(w, j, x, r0 + m0, y + (r0 + m0) * w.n + j * kPanel, w.n, cols);
      });
    }
  });
}

// The same products on AMX-INT8 tiles (tdpbusd: x's unsigned codes times the weights' signed
// ones, summed in int32, which is exact in any order) or on their software model. A step takes
// a group of 32 values of k for 32 rows of x (two A tiles of 16 rows x 32 codes, read where
// quantize_rows put them) and a panel's 32 columns (two B tiles: the group's 8 quads of 16
// columns, where the VNNI path's packing has them, 128 bytes apart) into four 16 x 16 int32
// tiles, then stores them and ends the group as the VNNI tile does (end_group): the same bits as
// the VNNI path at every row count. With x's second bytes, 16 rows a step (two of the four sum
// tiles for them). int4 weights are widened to signed bytes in the same quad order once a panel.
constexpr bool kAmxInt8 = true;

template <Format F, bool Precise, class Tiles>
void amx_quad_rows(const Panels& w, int64_t j, const int8_t* quads, const QuantizedRows& x,
                   int64_t r0, int rows, float* y, int64_t y_stride, int cols) {
  constexpr int kStep = Precise ? 16 : 32;
  constexpr int64_t kQuadBytes = 4 * kPanel;
  alignas(64) int32_t sums[32][kPanel];  // rows 0-15 (and 16-31, or with Precise their v sums)
  __m512 lo[kStep], hi[kStep];
  for (int i = 0; i < rows; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  const bool two = Precise || rows > 16;
  for (int64_t g = 0; g < w.groups(); ++g) {
    const int8_t* b = quads + g * kQuadsPerGroup * kQuadBytes;
    const uint8_t* a = x.u.data() + r0 * x.k + g * kGroup;
    Tiles::template zero<0>();
    Tiles::template zero<1>();
    Tiles::template load<6>(b, kQuadBytes);
    Tiles::template load<7>(b + 2 * kPanel, kQuadBytes);
    Tiles::template load<4>(a, x.k);
    Tiles::template dot_int8<0, 4, 6>();
    Tiles::template dot_int8<1, 4, 7>();
    if (two) {
      Tiles::template zero<2>();
      Tiles::template zero<3>();
      Tiles::template load<5>(Precise ? x.v.data() + r0 * x.k + g * kGroup : a + 16 * x.k, x.k);
      Tiles::template dot_int8<2, 5, 6>();
      Tiles::template dot_int8<3, 5, 7>();
    }
    Tiles::template store<0>(sums[0], kPanel * 4);
    Tiles::template store<1>(sums[0] + 16, kPanel * 4);
    if (two) {
      Tiles::template store<2>(sums[16], kPanel * 4);
      Tiles::template store<3>(sums[16] + 16, kPanel * 4);
    }
    const int64_t at = (j * w.groups() + g) * kPanel;  // the group's scales, sums and mins
    const __m512 s_lo = _mm512_loadu_ps(w.scale + at), s_hi = _mm512_loadu_ps(w.scale + at + 16);
    const __m512 ws_lo = _mm512_loadu_ps(w.sums + at), ws_hi = _mm512_loadu_ps(w.sums + at + 16);
    for (int i = 0; i < rows; ++i) {
      const int32_t* u = sums[i];
      const int32_t* v = Precise ? sums[16 + i] : u;
      end_group<F, Precise>(x, (r0 + i) * x.groups + g, _mm512_load_si512(u),
                            _mm512_load_si512(u + 16), _mm512_load_si512(v),
                            _mm512_load_si512(v + 16), s_lo, s_hi, ws_lo, ws_hi,
                            F == Format::W4A8 ? w.min + at : nullptr, lo[i], hi[i]);
    }
  }
  for (int i = 0; i < rows; ++i) store(y + i * y_stride, lo[i], hi[i], cols);
}

// W4A8 panel j's quads as signed bytes in W8A8's order: quad v's 32 columns, 4 k each.
void widen_quads(const Panels& w, int64_t j, int8_t* out) {
  const int64_t quads = w.k / 4;
  const uint8_t* q = w.q4 + j * quads * 2 * kPanel;
  const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  for (int64_t v = 0; v < quads; ++v) {
    const __m512i bytes = _mm512_loadu_si512(q + v * 2 * kPanel);
    _mm512_storeu_si512(out + v * 4 * kPanel, _mm512_sub_epi8(_mm512_and_si512(bytes, nibble), eight));
    _mm512_storeu_si512(out + v * 4 * kPanel + 2 * kPanel, _mm512_sub_epi8(
        _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble), eight));
  }
}

template <Format F, bool Precise, class Tiles>
void amx_quads_run(const Panels& w, const QuantizedRows& x, float* y, int64_t r0, int64_t m) {
  constexpr int kStep = Precise ? 16 : 32;
  at::parallel_for(0, w.num_panels, 1, [&](int64_t begin, int64_t end) {
    Tiles::template configure<amx::Layout::Int8Groups>();
    const auto scratch = scratch_of<int8_t>(F == Format::W4A8 ? w.k * kPanel : 0);
    for (int64_t j = begin; j < end; ++j) {
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, w.n - j * kPanel));
      const int8_t* quads = w.q8 + j * w.k * kPanel;
      if constexpr (F == Format::W4A8) {
        widen_quads(w, j, scratch.get());
        quads = scratch.get();
      }
      for (int64_t m0 = 0; m0 < m; m0 += kStep)
        amx_quad_rows<F, Precise, Tiles>(w, j, quads, x, r0 + m0,
                                         static_cast<int>(std::min<int64_t>(kStep, m - m0)),
                                         y + (r0 + m0) * w.n + j * kPanel, w.n, cols);
    }
    Tiles::release();
  });
}

// The run function of each format, precision and units.
template <Format F, bool Precise>
auto quads_runner(QuadUnits units) {
  using Run = void (*)(const Panels&, const QuantizedRows&, float*, int64_t, int64_t);
#if defined(JETSERVE_AMX)
  if (units == QuadUnits::AmxTiles) return Run{amx_quads_run<F, Precise, amx::Tiles>};
#endif
  if (units == QuadUnits::AmxModel) return Run{amx_quads_run<F, Precise, amx::Model>};
  return Run{quads_run<F, Precise>};
}

#elif defined(__AVX2__) && defined(__FMA__)
// The same int8 activations on AVX2 without VNNI (Zen 2 and 3; Intel's client cores from Haswell
// to Comet Lake, and from Alder Lake, whose 256-bit AVX-VNNI is not used here yet; Skylake-SP,
// whose AVX-512 has no VNNI), over the same quads, multiplied with
// vpmaddwd: x's bytes and the weights widened to 16 bits, each 32-bit lane two products and
// their sum, twice an fp32 FMA's products. (vpmaddubsw would take the bytes as they are, but
// its 16-bit sum of two products saturates: 2 * 255 * 127 is past 32,767.) The 16 bytes of
// four columns' quads widen into one vector whose lanes are (column c, k pair 0), (c, pair 1),
// (c + 1, pair 0), ...; a row's four k of x, broadcast as 64 bits, meet them in the same order,
// and each group's end adds the neighbouring lanes (vphaddd). The int32 sums are the VNNI
// path's, and the group's end is its arithmetic, 8 lanes at a time (the same operations in the
// same order; -ffast-math leaves the compiler free to round them otherwise, so the outputs agree
// to fp32 rounding, not to the bit).
constexpr bool kInt8Dot = true;
constexpr int64_t kQuadsPerGroup = kGroup / 4;
constexpr int64_t kQuadGroupsAhead = 8;  // groups a panel's quads are asked for ahead
constexpr int64_t kWidenRows = 8;        // past this many rows, an int4 panel is widened first

// The int8 path's pattern for dot_peak_flops: vpmaddwd products added into int32 sums by
// vpaddd, 12 pairs an iteration, 8 lanes each. In assembly: GCC keeps an array of integer
// vectors (and even named ones) on the stack here, and a stored sum's reload would be what is
// measured. Returns the sums' total, for the caller to keep.
float int8_pairs_chains(int64_t iters) {
  __m256i s0 = _mm256_set1_epi32(1), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0;
  const __m256i a = _mm256_set1_epi32(0x00050004), b = _mm256_set1_epi32(0x00030002);
  for (int64_t it = 0; it < iters; ++it) {
    __asm__(
        "vpmaddwd %[b], %[a], %%ymm14\n\tvpaddd %%ymm14, %0, %0\n\t"
        "vpmaddwd %[b], %[a], %%ymm15\n\tvpaddd %%ymm15, %1, %1\n\t"
        "vpmaddwd %[b], %[a], %%ymm14\n\tvpaddd %%ymm14, %2, %2\n\t"
        "vpmaddwd %[b], %[a], %%ymm15\n\tvpaddd %%ymm15, %3, %3\n\t"
        "vpmaddwd %[b], %[a], %%ymm14\n\tvpaddd %%ymm14, %4, %4\n\t"
        "vpmaddwd %[b], %[a], %%ymm15\n\tvpaddd %%ymm15, %5, %5\n\t"
        "vpmaddwd %[b], %[a], %%ymm14\n\tvpaddd %%ymm14, %0, %0\n\t"
        "vpmaddwd %[b], %[a], %%ymm15\n\tvpaddd %%ymm15, %1, %1\n\t"
        "vpmaddwd %[b], %[a], %%ymm14\n\tvpaddd %%ymm14, %2, %2\n\t"
        "vpmaddwd %[b], %[a], %%ymm15\n\tvpaddd %%ymm15, %3, %3\n\t"
        "vpmaddwd %[b], %[a], %%ymm14\n\tvpaddd %%ymm14, %4, %4\n\t"
        "vpmaddwd %[b], %[a], %%ymm15\n\tvpaddd %%ymm15, %5, %5"
        : "+x"(s0), "+x"(s1), "+x"(s2), "+x"(s3), "+x"(s4), "+x"(s5)
        : [a] "x"(a), [b] "x"(b)
        : "xmm14", "xmm15");
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(
      _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3)), _mm256_add_epi32(s4, s5)));
  float sink = 0.0f;
  for (const int32_t lane : lanes) sink += static_cast<float>(lane);
  return sink;
}

// x [m, K] quantized per row and group of 32 as on the VNNI path (there, above), the codes kept
// as 16-bit lanes for vpmaddwd.
using QuantizedRows = CodedRows<int16_t>;

inline float reduce_min8(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t reduce_add8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// 16 codes (0 .. 255 in int32 lanes) stored as int16, in order.
inline void store_codes(int16_t* out, __m256i a, __m256i b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
}

QuantizedRows quantize_rows(const float* x, int64_t x_stride, int64_t m, int64_t k, bool precise,
                            bool padded) {
  const int64_t groups = k / kGroup;
  QuantizedRows r(m, k, precise, padded);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    const __m256i cap = _mm256_set1_epi32(255);
    for (int64_t i = begin; i < end; ++i)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = i * groups + g;
        const float* xg = x + i * x_stride + g * kGroup;
        __m256 a[4];
        for (int c = 0; c < 4; ++c) a[c] = _mm256_loadu_ps(xg + 8 * c);
        float low = reduce_min8(_mm256_min_ps(_mm256_min_ps(a[0], a[1]), _mm256_min_ps(a[2], a[3])));
        float high = reduce_max8(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
        // A NaN in the group: scale and low NaN, so the output is NaN (min / max pass it over).
        __m256 unordered = _mm256_setzero_ps();
        for (int c = 0; c < 4; ++c) unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a[c], a[c], _CMP_UNORD_Q));
        if (_mm256_movemask_ps(unordered)) low = high = std::numeric_limits<float>::quiet_NaN();
        const float inverse = high > low ? 255.0f / (high - low) : 0.0f;
        const float scale = high > low ? (high - low) / 255.0f : high - low;
        const __m256 lo = _mm256_set1_ps(low), inv = _mm256_set1_ps(inverse);
        __m256i u[4];
        for (int c = 0; c < 4; ++c)  // (a failed conversion, 0x80000000, becomes 255)
          u[c] = _mm256_min_epu32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(a[c], lo), inv)), cap);
        int16_t* out = r.u.data() + i * k + g * kGroup;
        store_codes(out, u[0], u[1]);
        store_codes(out + 16, u[2], u[3]);
        r.scale[at] = scale;
        float xsum = scale * static_cast<float>(reduce_add8(
            _mm256_add_epi32(_mm256_add_epi32(u[0], u[1]), _mm256_add_epi32(u[2], u[3]))));
        if (precise) {
          const float rscale = scale / 254.0f;
          const __m256 s = _mm256_set1_ps(scale), rinv = _mm256_set1_ps(high > low ? 254.0f / scale : 0.0f);
          const __m256i bias = _mm256_set1_epi32(128), one = _mm256_set1_epi32(1);
          __m256i v[4];
          for (int c = 0; c < 4; ++c) {
            const __m256 rest = _mm256_sub_ps(_mm256_sub_ps(a[c], lo), _mm256_mul_ps(_mm256_cvtepi32_ps(u[c]), s));
            v[c] = _mm256_max_epi32(_mm256_min_epi32(_mm256_add_epi32(
                _mm256_cvtps_epi32(_mm256_mul_ps(rest, rinv)), bias), cap), one);
          }
          int16_t* rest = r.v.data() + i * k + g * kGroup;
          store_codes(rest, v[0], v[1]);
          store_codes(rest + 16, v[2], v[3]);
          r.rscale[at] = rscale;
          low -= 128.0f * rscale;
          xsum += rscale * static_cast<float>(reduce_add8(
              _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]))));
        }
        r.low[at] = low;
        r.xsum[at] = xsum;
      }
  });
  return r;
}

// y[0 .. MR, 0 .. cols) for the 4 CV columns of panel j from column c0 (c0 a multiple of 4 CV),
// cols at most 4 CV; F W8A8 or W4A8; Precise: x's second bytes too; Widened: the panel's
// weights from widen_panel's scratch, else widened here as they stream in, and asked for ahead
// where `first` (the panel's first tile, which asks for both halves: the others find them in
// cache). (Every loop over the
// rows and vectors unrolled, so that the int32 sums stay in registers.)
template <Format F, int MR, int CV, bool Precise, bool Widened>
void quad_tile(const Panels& w, int64_t j, int c0, const int16_t* widened, bool first,
               const QuantizedRows& x, int64_t r0, float* y, int64_t y_stride, int cols) {
  static_assert(CV % 2 == 0, "the group's end adds the lanes of vectors in pairs");
  constexpr int64_t kQuadBytes = F == Format::W8A8 ? 4 * kPanel : 2 * kPanel;
  const uint8_t* q = (F == Format::W8A8 ? reinterpret_cast<const uint8_t*>(w.q8) : w.q4) +
                     j * (w.k / 4) * kQuadBytes;
  const int64_t at0 = j * w.groups() * kPanel + c0;  // the tile's scales in group 0
  const float* s = w.scale + at0;
  const float* sums = w.sums + at0;
  const float* mins = F == Format::W4A8 ? w.min + at0 : nullptr;
  const int chunk0 = c0 / 4;  // the tile's first vector of four columns in a quad (of 8)
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi16(8);
  alignas(32) float acc[MR][4 * CV] = {};
  for (int64_t g = 0; g < w.groups(); ++g) {
    const uint8_t* qg = q + g * kQuadsPerGroup * kQuadBytes;
    if (!Widened && first)
      request(qg + kQuadGroupsAhead * kQuadsPerGroup * kQuadBytes, kQuadsPerGroup * kQuadBytes);
    __m256i sum[MR][CV], rest[Precise ? MR : 1][CV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < CV; ++c) sum[i][c] = rest[Precise ? i : 0][c] = _mm256_setzero_si256();
    const int64_t x_at = r0 * x.k + g * kGroup;
#pragma GCC unroll 8
    for (int64_t v = 0; v < kQuadsPerGroup; ++v) {
      __m256i wq[CV];  // four columns each, their four k
#pragma GCC unroll 8
      for (int c = 0; c < CV; ++c) {
        const int chunk = chunk0 + c;
        if constexpr (Widened) {
          wq[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              widened + (g * kQuadsPerGroup + v) * 4 * kPanel + 16 * chunk));
        } else if constexpr (F == Format::W8A8) {
          wq[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(qg + v * kQuadBytes + 16 * chunk)));
        } else {  // columns 0 .. 16 the low nibbles, 16 .. 32 the high ones, minus 8
          const __m128i bytes = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(qg + v * kQuadBytes + 16 * (chunk % 4)));
          const __m128i nibbles = _mm_and_si128(chunk < 4 ? bytes : _mm_srli_epi16(bytes, 4), nibble);
          wq[c] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(nibbles), eight);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int64_t quad;
        std::memcpy(&quad, x.u.data() + x_at + i * x.k + v * 4, sizeof quad);
        const __m256i xv = _mm256_set1_epi64x(quad);
#pragma GCC unroll 8
        for (int c = 0; c < CV; ++c) sum[i][c] = _mm256_add_epi32(sum[i][c], _mm256_madd_epi16(xv, wq[c]));
        if constexpr (Precise) {
          std::memcpy(&quad, x.v.data() + x_at + i * x.k + v * 4, sizeof quad);
          const __m256i rv = _mm256_set1_epi64x(quad);
#pragma GCC unroll 8
          for (int c = 0; c < CV; ++c) rest[i][c] = _mm256_add_epi32(rest[i][c], _mm256_madd_epi16(rv, wq[c]));
        }
      }
      // The sums in registers at the end of each quad: else GCC interleaves the unrolled quads
      // and spills sums to the stack.
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int c = 0; c < CV; ++c) {
          __asm__("" : "+x"(sum[i][c]));
          if constexpr (Precise) __asm__("" : "+x"(rest[i][c]));
        }
    }
    // As the VNNI path: y += scale_w * (sx * sum(q u) [+ rx * sum(q v)]) [+ min * xsum] + low * sum(w)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int64_t at = (r0 + i) * x.groups + g;
      const __m256 sx = _mm256_set1_ps(x.scale[at]), low = _mm256_set1_ps(x.low[at]);
#pragma GCC unroll 4
      for (int e = 0; e < CV / 2; ++e) {  // columns 8e .. 8e + 8: the pairs' lanes added, in order
        const __m256i dots = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sum[i][2 * e], sum[i][2 * e + 1]), 0xD8);
        __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(dots), sx);
        if constexpr (Precise) {
          const __m256i rests = _mm256_permute4x64_epi64(_mm256_hadd_epi32(rest[i][2 * e], rest[i][2 * e + 1]), 0xD8);
          d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rests), _mm256_set1_ps(x.rscale[at]), d);
        }
        d = _mm256_mul_ps(d, _mm256_loadu_ps(s + g * kPanel + 8 * e));
        if constexpr (F == Format::W4A8)
          d = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g * kPanel + 8 * e), _mm256_set1_ps(x.xsum[at]), d);
        float* a = acc[i] + 8 * e;
        _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_loadu_ps(sums + g * kPanel + 8 * e), low,
                                           _mm256_add_ps(d, _mm256_load_ps(a))));
      }
    }
  }
  for (int i = 0; i < MR; ++i) std::copy(acc[i], acc[i] + cols, y + i * y_stride);
}

// W4A8 panel j's weights as 16-bit lanes (q - 8) in the order the tiles read them: for each quad
// of k, the eight vectors of four columns (columns 0 .. 4 first: the low nibbles, then the high).
void widen_panel(const Panels& w, int64_t j, int16_t* out) {
  const int64_t quads = w.k / 4;
  const uint8_t* q = w.q4 + j * quads * 2 * kPanel;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi16(8);
  for (int64_t v = 0; v < quads; ++v)
    for (int c = 0; c < 4; ++c) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + v * 2 * kPanel + 16 * c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + v * 128 + 16 * c), _mm256_sub_epi16(
          _mm256_cvtepu8_epi16(_mm_and_si128(bytes, nibble)), eight));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + v * 128 + 64 + 16 * c), _mm256_sub_epi16(
          _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble)), eight));
    }
}

template <Format F, bool Precise>
void quads_run(const Panels& w, const QuantizedRows& x, float* y, int64_t r0, int64_t m) {
  // Tiles of 16 columns, two rows (one with the second bytes): 8 int32 sums. int4 weights past
  // a decode's rows are widened once a panel into scratch (L1 / L2) for every tile; int8 ones
  // widen as they stream in, which measured as fast.
  const bool widen = F == Format::W4A8 && m > kWidenRows;
  at::parallel_for(0, w.num_panels, 1, [&](int64_t begin, int64_t end) {
    const auto scratch = scratch_of<int16_t>(widen ? w.k * kPanel : 0);
    for (int64_t j = begin; j < end; ++j) {
      const int panel_cols = static_cast<int>(std::min<int64_t>(kPanel, w.n - j * kPanel));
      if constexpr (F == Format::W4A8)
        if (widen) widen_panel(w, j, scratch.get());
      for (int c0 = 0; c0 < panel_cols; c0 += 16) {
        const int cols = std::min(16, panel_cols - c0);
        for_each_tile<Precise ? 1 : 2>(m, [&]<int R>(int64_t m0) {
          float* yt = y + (r0 + m0) * w.n + j * kPanel + c0;
          if constexpr (F == Format::W4A8)
            if (widen) {
              quad_tile<F, R, 4, Precise, true>(w, j, c0, scratch.get(), false, x, r0 + m0, yt,
                                                w.n, cols);
              return;
            }
          quad_tile<F, R, 4, Precise, false>(w, j, c0, nullptr, m0 == 0 && c0 == 0, x, r0 + m0, yt, w.n,
                                             cols);
        });
      }
    }
  });
}

constexpr bool kAmxInt8 = false;  // (AMX-INT8 comes with VNNI; the tiles end groups on AVX-512)

template <Format F, bool Precise>
auto quads_runner(QuadUnits) {
  using Run = void (*)(const Panels&, const QuantizedRows&, float*, int64_t, int64_t);
  return Run{quads_run<F, Precise>};
}

#else
constexpr bool kInt8Dot = false;
constexpr bool kAmxInt8 = false;
void quads_matmul(const Panels&, const float*, int64_t, float*, int64_t, bool, QuadUnits) {
  TORCH_CHECK(false, "int8 activations need AVX512-VNNI or AVX2, which this build does not have");
}
#endif

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
// y = x w^T with x quantized on entry, in either instruction set's quads_run.
void quads_matmul(const Panels& w, const float* x, int64_t x_stride, float* y, int64_t m,
                  bool precise, QuadUnits units) {
  const QuantizedRows xq = quantize_rows(x, x_stride, m, w.k, precise, units != QuadUnits::Vector);
  const auto run = w.format == Format::W8A8
      ? (precise ? quads_runner<Format::W8A8, true>(units) : quads_runner<Format::W8A8, false>(units))
      : (precise ? quads_runner<Format::W4A8, true>(units) : quads_runner<Format::W4A8, false>(units));
  // Blocks of rows as panels_matmul takes them, so a block's rows stay in L2 across panels.
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t rows = ((m + blocks - 1) / blocks + kPanelRows - 1) / kPanelRows * kPanelRows;
  for (int64_t m0 = 0; m0 < m; m0 += rows) run(w, xq, y, m0, std::min(rows, m - m0));
}
#endif

// Many rows in bfloat16 with fp32 sums, where the CPU has AMX tiles (several times the fp32
// FMAs): W dequantized a block of panels at a time into [K, columns] for torch's matmul.
torch::Tensor run_bf16_blas(const Panels& w, const torch::Tensor& x) {
  constexpr int64_t kBlockPanels = 16;
  const int64_t m = x.size(0);
  auto y = torch::empty({m, w.n}, x.options());
  auto block = torch::empty({w.k, kBlockPanels * kPanel}, x.options());
  const auto xb = x.to(torch::kBFloat16);
  for (int64_t j0 = 0; j0 < w.num_panels; j0 += kBlockPanels) {
    const int64_t panels = std::min(kBlockPanels, w.num_panels - j0);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j)
        w.dequant(j0 + j, block.data_ptr<float>() + j * kPanel, block.stride(0));
    });
    const int64_t cols = std::min(panels * kPanel, w.n - j0 * kPanel);
    auto w_block = block.narrow(1, 0, cols).to(torch::kBFloat16);
    y.narrow(1, j0 * kPanel, cols).copy_(torch::mm(xb, w_block));
  }
  return y;
}

void check_x(const torch::Tensor& x, int64_t k, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, name,
              ": x must be fp32 [M, K] with contiguous rows");
  TORCH_CHECK(x.size(1) == k, name, ": x has ", x.size(1), " columns, the weight ", k);
}

void check_scales(const torch::Tensor& t, const Panels& w, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat32 && t.dim() == 3 &&
              t.size(0) == w.num_panels && t.size(1) == w.groups() && t.size(2) == kPanel,
              name, ": one fp32 value per 32 weights, [N / 32, K / 32, 32]");
}

// Below this many rows the panel kernel, which streams the weights once, beats AMX BLAS.
constexpr int64_t kAmxRows = 49;
// From this many rows int8 activations run on AMX-INT8 tiles where many_rows asks for them (a
// guess, to be measured on an AMX CPU: loadtest/amx_check.sh).
constexpr int64_t kAmxInt8Rows = 16;

// many_rows: how more than kScratchRows rows multiply quantized weights: "fp32"; "bf16"
// (AVX512-BF16 dot products); "amx" (from kAmxRows rows, torch's bf16 matmul on AMX tiles). With
// int8 activations every row count below "amx"'s runs on the int8 dot products.
torch::Tensor run(const Panels& w, const torch::Tensor& x, const std::string& many_rows,
                  bool second_byte = false) {
  const int64_t m = x.size(0);
  TORCH_CHECK(w.n > (w.num_panels - 1) * kPanel && w.n <= w.num_panels * kPanel,
              "linear: ", w.n, " output columns do not fill ", w.num_panels, " panels");
  const bool quads = w.format == Format::W8A8 || w.format == Format::W4A8;
  const bool amx_int8 = many_rows == "amx_int8" || many_rows == "amx_int8_model";
  TORCH_CHECK(many_rows == "fp32" || many_rows == "amx" || (many_rows == "bf16" && kBf16Dot) ||
              (amx_int8 && quads && kAmxInt8),
              "linear: many_rows must be fp32", kBf16Dot ? ", bf16" : "",
              kAmxInt8 && quads ? ", amx, amx_int8 or amx_int8_model" : " or amx",
              " on this build, not ", many_rows);
  TORCH_CHECK(many_rows != "amx_int8" || amx::available_int8(),
              "linear: no AMX-INT8 tiles here (the CPU or its kernel gives none, or the kernels "
              "were built without AVX512-BF16, which the AMX code needs)");
  if (many_rows == "amx" && m >= kAmxRows) return run_bf16_blas(w, x);
  auto y = torch::empty({m, w.n}, x.options());
  if (quads) {
    // AMX-INT8 tiles from kAmxInt8Rows rows (the same bits as the vector tiles below them);
    // their software model at every row count
    const QuadUnits units = many_rows == "amx_int8_model" ? QuadUnits::AmxModel
                            : many_rows == "amx_int8" && m >= kAmxInt8Rows ? QuadUnits::AmxTiles
                                                                            : QuadUnits::Vector;
    if (m > 0)
      quads_matmul(w, x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), m, second_byte,
                   units);
    return y;
  }
  if (m > 0)  // below kAmxRows, "amx" runs as "bf16" where that is built in
    panels_matmul(w, x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), m,
                  many_rows != "fp32" && kBf16Dot);
  return y;
}

}  // namespace

torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& panels) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
              panels.scalar_type() == torch::kFloat32,
              "linear_f32: the weight must be fp32 panels [N / ", kPanel, ", K, ", kPanel, "]");
  check_x(x, panels.size(1), "linear_f32");
  Panels w{Format::F32, panels.size(0), panels.size(1), panels.size(0) * kPanel};
  w.f32 = panels.data_ptr<float>();
  return run(w, x, "fp32");
}

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                          const std::string& many_rows) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
              panels.scalar_type() == torch::kBFloat16,
              "linear_bf16: the weight must be bf16 panels [N / ", kPanel, ", K, ", kPanel, "]");
  TORCH_CHECK(panels.size(1) % kGroup == 0, "linear_bf16: K must be a multiple of ", kGroup);
  check_x(x, panels.size(1), "linear_bf16");
  Panels w{Format::BF16, panels.size(0), panels.size(1), n};
  w.b16 = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  return run(w, x, many_rows);
}

torch::Tensor linear_bf16_pairs(const torch::Tensor& x, const torch::Tensor& pairs, int64_t n,
                                const std::string& units) {
  TORCH_CHECK(kBf16Dot, "linear_bf16_pairs needs AVX512-BF16, which this build does not have");
  TORCH_CHECK(units == "avx512" || units == "amx" || units == "amx_model",
              "linear_bf16_pairs: units must be avx512, amx or amx_model, not ", units);
  TORCH_CHECK(units != "amx" || amx::available(),
              "linear_bf16_pairs: this CPU (or its kernel) gives no AMX-BF16 tiles");
  TORCH_CHECK(pairs.dim() == 4 && pairs.size(2) == kPanel && pairs.size(3) == 2 &&
              pairs.is_contiguous() && pairs.scalar_type() == torch::kBFloat16,
              "linear_bf16_pairs: the weight must be bf16 pairs [N / ", kPanel, ", K / 2, ", kPanel,
              ", 2]");
  const int64_t k = 2 * pairs.size(1);
  TORCH_CHECK(k % kGroup == 0, "linear_bf16_pairs: K must be a multiple of ", kGroup);
  TORCH_CHECK(n > (pairs.size(0) - 1) * kPanel && n <= pairs.size(0) * kPanel,
              "linear_bf16_pairs: ", n, " output columns do not fill ", pairs.size(0), " panels");
  check_x(x, k, "linear_bf16_pairs");
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  const auto* w = reinterpret_cast<const uint32_t*>(pairs.data_ptr());
  const auto run = units == "avx512" ? pairs_run
#if defined(JETSERVE_AMX)
                   : units == "amx" ? tiles_run<amx::Tiles>
#endif
                   : tiles_run<amx::Model>;
  for_each_row_block(m, bf16_block_rows(k), [&](int64_t m0, int64_t rows) {
    run(w, pairs.size(0), k, n, x.data_ptr<float>() + m0 * x.stride(0), x.stride(0),
        y.data_ptr<float>() + m0 * n, rows);
  });
#endif
  return y;
}

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          int64_t n, const std::string& many_rows) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kPanel && q.is_contiguous() &&
              q.scalar_type() == torch::kInt8, "linear_int8: q must be int8 panels [N / 32, K, 32]");
  TORCH_CHECK(q.size(1) % kGroup == 0, "linear_int8: K must be a multiple of ", kGroup);
  check_x(x, q.size(1), "linear_int8");
  Panels w{Format::Int8, q.size(0), q.size(1), n};
  check_scales(scale, w, "linear_int8 scale");
  w.q8 = q.data_ptr<int8_t>();
  w.scale = scale.data_ptr<float>();
  return run(w, x, many_rows);
}

torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& min, int64_t n, const std::string& many_rows) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kPanel / 2 && q.is_contiguous() &&
              q.scalar_type() == torch::kUInt8,
              "linear_int4: q must be uint8 panels [N / 32, K, 16]");
  TORCH_CHECK(q.size(1) % kGroup == 0, "linear_int4: K must be a multiple of ", kGroup);
  check_x(x, q.size(1), "linear_int4");
  Panels w{Format::Int4, q.size(0), q.size(1), n};
  check_scales(scale, w, "linear_int4 scale");
  check_scales(min, w, "linear_int4 min");
  w.q4 = q.data_ptr<uint8_t>();
  w.scale = scale.data_ptr<float>();
  w.min = min.data_ptr<float>();
  return run(w, x, many_rows);
}

// The checks both int8-activation formats share: q's quads, the scales and the group sums.
Panels quad_panels(Format format, const torch::Tensor& x, const torch::Tensor& q,
                   const torch::Tensor& scale, const torch::Tensor& sums, int64_t n,
                   const char* name) {
  TORCH_CHECK(kInt8Dot, name, ": int8 activations need AVX512-VNNI or AVX2, not built in here");
  const bool w8 = format == Format::W8A8;
  TORCH_CHECK(q.dim() == 4 && q.size(2) == (w8 ? kPanel : kPanel / 2) && q.size(3) == 4 &&
              q.is_contiguous() && q.scalar_type() == (w8 ? torch::kInt8 : torch::kUInt8),
              name, ": q must be ", w8 ? "int8 quads [N / 32, K / 4, 32, 4]"
                                       : "uint8 quads [N / 32, K / 4, 16, 4]");
  TORCH_CHECK(q.size(1) * 4 % kGroup == 0, name, ": K must be a multiple of ", kGroup);
  check_x(x, q.size(1) * 4, name);
  Panels w{format, q.size(0), q.size(1) * 4, n};
  check_scales(scale, w, (std::string(name) + " scale").c_str());
  check_scales(sums, w, (std::string(name) + " sums").c_str());
  w.scale = scale.data_ptr<float>();
  w.sums = sums.data_ptr<float>();
  return w;
}

torch::Tensor linear_w8a8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& sums, int64_t n, const std::string& many_rows,
                          bool second_byte) {
  Panels w = quad_panels(Format::W8A8, x, q, scale, sums, n, "linear_w8a8");
  w.q8 = q.data_ptr<int8_t>();
  return run(w, x, many_rows, second_byte);
}

torch::Tensor linear_w4a8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& min, const torch::Tensor& sums, int64_t n,
                          const std::string& many_rows, bool second_byte) {
  Panels w = quad_panels(Format::W4A8, x, q, scale, sums, n, "linear_w4a8");
  check_scales(min, w, "linear_w4a8 min");
  w.q4 = q.data_ptr<uint8_t>();
  w.min = min.data_ptr<float>();
  return run(w, x, many_rows, second_byte);
}

// The most the cores can multiply, for a benchmark to measure a kernel against: every intra-op
// thread runs 12 independent chains of one instruction (fp32 FMA, vdpbf16ps, vpdpbusd) on
// registers, no memory. Flops (int8: integer operations) a second, a product and its sum two.
// AVX2 builds: fp32 FMAs on 8-lane vectors. int8 without VNNI (AVX2, and AVX-512 builds without
// it, which run the AVX2 kernel): the kernel's vpmaddwd and vpaddd pairs (int8_pairs_chains).
double dot_peak_flops(const std::string& kind, int64_t iters) {
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
  TORCH_CHECK(false, "dot_peak_flops needs AVX-512 or AVX2, which this build does not have");
#endif
  TORCH_CHECK(kind == "fp32" || (kind == "bf16" && kBf16Dot) || (kind == "int8" && kInt8Dot),
              "dot_peak_flops: fp32", kBf16Dot ? ", bf16" : "", kInt8Dot ? ", int8" : "",
              " on this build, not ", kind);
  const int threads = at::get_num_threads();
  const int mode = kind == "fp32" ? 0 : kind == "bf16" ? 1 : 2;
  std::vector<float> sinks(threads);
  const auto start = std::chrono::steady_clock::now();
  volatile float kept = 0.0f;  // the chains' results used, so that none is optimised away
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
  if (mode == 2) {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) sinks[t] = int8_pairs_chains(iters);
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (const float sink : sinks) kept = kept + sink;
    // Two products and their two sums (vpmaddwd's and vpaddd's) a lane, 8 lanes.
    return 8.0 * 4 * 12 * static_cast<double>(iters) * threads / seconds;
  }
#endif
#if defined(__AVX512F__)
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      __m512 acc[12];
      __m512i iacc[12];
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(1e-3f * i), iacc[i] = _mm512_set1_epi32(i);
      const __m512 a = _mm512_set1_ps(0.999f);
      const __m512i b = _mm512_set1_epi32(0x3f803f80);  // bf16 pairs (1, 1); int8 quads
      if (mode == 0) {
        for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
          for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, a);
#if defined(__AVX512BF16__)
      } else if (mode == 1) {
        for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
          for (int i = 0; i < 12; ++i) acc[i] = dot_pairs(acc[i], b, b);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      } else {
        for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
          for (int i = 0; i < 12; ++i) iacc[i] = _mm512_dpbusd_epi32(iacc[i], b, b);
#endif
      }
      float sink = 0.0f;
      for (int i = 0; i < 12; ++i)
        sink += _mm512_reduce_add_ps(acc[i]) + static_cast<float>(_mm512_reduce_add_epi32(iacc[i]));
      sinks[t] = sink;
    }
  });
  constexpr double kLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__)
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      __m256 acc[12];
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(1e-3f * i);
      const __m256 a = _mm256_set1_ps(0.999f);
      for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, a);
      alignas(32) float lanes[8];
      float sink = 0.0f;
      for (int i = 0; i < 12; ++i) {
        _mm256_store_ps(lanes, acc[i]);
        for (const float lane : lanes) sink += lane;
      }
      sinks[t] = sink;
    }
  });
  constexpr double kLanes = 8;
#else
  constexpr double kLanes = 16;
#endif
  (void)mode;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // A product and its sum: 2 flops a lane (fp32), 4 (a bf16 pair), 8 (an int8 quad).
  const double per_instruction = kLanes * (kind == "fp32" ? 2 : kind == "bf16" ? 4 : 8);
  for (const float sink : sinks) kept = kept + sink;
  return per_instruction * 12 * static_cast<double>(iters) * threads / seconds;
}

bool bf16_dot_products() { return kBf16Dot; }
bool amx_bf16() { return kBf16Dot && amx::available(); }

bool amx_int8() { return kAmxInt8 && amx::available_int8(); }
bool int8_dot_products() { return kInt8Dot; }
