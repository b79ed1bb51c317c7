// y = x W^T for the CPU, with W in fp32, int8 or int4 (weight-only quantization, fp32 activations).
//
// Decode steps multiply a few rows of activations by every weight of the model, so they are bound
// by how fast the weights stream in. BLAS libraries pack the weight matrix on every call for small
// M, which costs more than the product itself. These kernels read W once, in its stored format.
//
// fp32 W is stored packed, once at load, in panels of 32 output columns: P [N / 32, K, 32], so
// each panel is one contiguous stream. A register tile holds up to 12 rows of x times the panel's
// 32 columns (24 accumulators) and adds x[i, k] * P[k, :] for every k: no horizontal sums, and
// the stream is asked for well ahead of its use (one core alone cannot keep enough lines in
// flight to reach the memory's bandwidth while it also computes). The same kernel serves every M:
// a panel (K * 128 bytes) stays in L2 while further tiles of x pass over it.
//
// Quantized W stays in place in row-major groups: each weight vector is loaded and dequantized
// once per tile and multiplied into up to 4 rows of x held in registers. Larger M goes through
// BLAS (after dequantizing W block by block).
//
// Quantized layouts, in groups of 32 along K (the layout of GGUF's Q8_0, Q4_0 and Q4_1 blocks):
//   int8: q int8 [N, K], scale fp32 [N, K/32];                         w = scale * q
//   int4: q uint8 [N, K/2], scale and min fp32 [N, K/32];              w = scale * q + min
//         byte j of a group holds weight j in its low nibble and weight j + 16 in its high one.

#include "ops.h"

#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int kMaxRows = 4;  // rows of x per register tile, against 4 rows of W
constexpr int kPanel = 32;   // output columns per panel of packed fp32 W

// Dequantized weights of one group, 32 floats, written to `out` (the portable path and the
// tiled BLAS path share these).
inline void dequant_group_int8(const int8_t* q, float scale, float* out) {
  for (int i = 0; i < kGroup; ++i) out[i] = scale * q[i];
}
inline void dequant_group_int4(const uint8_t* q, float scale, float min, float* out) {
  for (int i = 0; i < kGroup / 2; ++i) {
    out[i] = scale * (q[i] & 0xF) + min;
    out[i + kGroup / 2] = scale * (q[i] >> 4) + min;
  }
}

enum class Format { F32, Int8, Int4 };

struct Weight {
  Format format;
  int64_t n, k;
  const float* f32 = nullptr;
  const int8_t* q8 = nullptr;
  const uint8_t* q4 = nullptr;
  const float* scale = nullptr;
  const float* min = nullptr;

  // Row r's group g dequantized into out[0..32).
  void dequant(int64_t r, int64_t g, float* out) const {
    const int64_t groups = k / kGroup;
    switch (format) {
      case Format::F32:
        for (int i = 0; i < kGroup; ++i) out[i] = f32[r * k + g * kGroup + i];
        break;
      case Format::Int8:
        dequant_group_int8(q8 + r * k + g * kGroup, scale[r * groups + g], out);
        break;
      case Format::Int4:
        dequant_group_int4(q4 + r * (k / 2) + g * (kGroup / 2), scale[r * groups + g],
                           min[r * groups + g], out);
        break;
    }
  }
};

#if defined(__AVX512F__)
// The 32 weights of row r, group g, as two vectors of 16 floats.
template <Format F>
inline void load_group(const Weight& w, int64_t r, int64_t g, __m512& lo, __m512& hi) {
  const int64_t groups = w.k / kGroup;
  if constexpr (F == Format::F32) {
    const float* p = w.f32 + r * w.k + g * kGroup;
    lo = _mm512_loadu_ps(p);
    hi = _mm512_loadu_ps(p + 16);
  } else if constexpr (F == Format::Int8) {
    const int8_t* p = w.q8 + r * w.k + g * kGroup;
    const __m512 s = _mm512_set1_ps(w.scale[r * groups + g]);
    lo = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
    hi = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))));
  } else {
    const uint8_t* p = w.q4 + r * (w.k / 2) + g * (kGroup / 2);
    const __m512 s = _mm512_set1_ps(w.scale[r * groups + g]);
    const __m512 m = _mm512_set1_ps(w.min[r * groups + g]);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF));
    const __m512i high = _mm512_srli_epi32(bytes, 4);
    lo = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(low), m);
    hi = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(high), m);
  }
}

// Asks for row r's group g (its first cache line; fp32 groups span two) ahead of its use.
template <Format F>
inline void prefetch_group(const Weight& w, int64_t r, int64_t g) {
  const char* p;
  if constexpr (F == Format::F32) {
    p = reinterpret_cast<const char*>(w.f32 + r * w.k + g * kGroup);
    _mm_prefetch(p + 64, _MM_HINT_T0);
  } else if constexpr (F == Format::Int8) {
    p = reinterpret_cast<const char*>(w.q8 + r * w.k + g * kGroup);
  } else {
    p = reinterpret_cast<const char*>(w.q4 + r * (w.k / 2) + g * (kGroup / 2));
  }
  _mm_prefetch(p, _MM_HINT_T0);
}

// Rows [n0, n0 + NR) of W requested group by group (`ahead(g)`) while a tile computes, so the
// next tile's weights stream in from memory meanwhile instead of after it.
template <Format F, int NR>
struct Ahead {
  const Weight* w;
  int64_t n0;
  void operator()(int64_t g) const {
    for (int j = 0; j < NR && n0 + j < w->n; ++j) prefetch_group<F>(*w, n0 + j, g);
  }
};
struct NoAhead {
  void operator()(int64_t) const {}
};

// y[m0 .. m0+MR, n0 .. n0+NR] for one register tile: every weight is loaded once and multiplied
// into MR rows of x.
template <Format F, int MR, int NR, typename A = NoAhead>
void tile(const Weight& w, const float* x, int64_t x_stride, float* y, int64_t y_stride,
          int64_t m0, int64_t n0, A ahead = {}) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t groups = w.k / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo[NR], hi[NR];
    ahead(g);
    for (int j = 0; j < NR; ++j) load_group<F>(w, n0 + j, g, lo[j], hi[j]);
    for (int i = 0; i < MR; ++i) {
      const float* xr = x + (m0 + i) * x_stride + g * kGroup;
      const __m512 xl = _mm512_loadu_ps(xr);
      const __m512 xh = _mm512_loadu_ps(xr + 16);
      for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm512_fmadd_ps(xl, lo[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(xh, hi[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[(m0 + i) * y_stride + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// Rows [begin, end) of W dequantized into out (row r at out + (r - begin) * k).
void dequant_rows(const Weight& w, int64_t begin, int64_t end, float* out);

// All rows of x against W's rows [n0, n0 + NR): the NR weight rows stay in L1 while every tile
// of x passes over them, so W streams in from memory once whatever M is. Quantized rows are
// dequantized once into `scratch` (NR * K floats) when more than one tile of x needs them.
template <Format F, int NR>
void column_tile(const Weight& w, const float* x, int64_t x_stride, float* y, int64_t m,
                 int64_t n0, float* scratch) {
  // The first full tile and the last partial one ask for the next column tile's weights (from
  // `w`, quantized or not); a repeat request for lines already on their way costs little.
  const Ahead<F, NR> next{&w, n0 + NR};
  const Weight* src = &w;
  Weight dense{Format::F32, NR, w.k};
  if (F != Format::F32 && m > kMaxRows) {
    dequant_rows(w, n0, n0 + NR, scratch);
    dense.f32 = scratch;
    src = &dense;
    y += n0;  // the scratch rows are rows 0 .. NR of `dense`
    n0 = 0;
  }
  auto run = [&](auto format_tag) {
    constexpr Format G = decltype(format_tag)::value;
    int64_t m0 = 0;
    for (; m0 + kMaxRows <= m; m0 += kMaxRows) {
      if (m0 == 0)
        tile<G, kMaxRows, NR>(*src, x, x_stride, y, w.n, m0, n0, next);
      else
        tile<G, kMaxRows, NR>(*src, x, x_stride, y, w.n, m0, n0);
    }
    switch (m - m0) {
      case 3: tile<G, 3, NR>(*src, x, x_stride, y, w.n, m0, n0, next); break;
      case 2: tile<G, 2, NR>(*src, x, x_stride, y, w.n, m0, n0, next); break;
      case 1: tile<G, 1, NR>(*src, x, x_stride, y, w.n, m0, n0, next); break;
      default: break;
    }
  };
  if (src == &dense) {
    run(std::integral_constant<Format, Format::F32>{});
  } else {
    run(std::integral_constant<Format, F>{});
  }
}

// fp32 panels: P [panels, K, kPanel].
constexpr int kPanelRows = 12;
// How far ahead of its use the panel stream is requested, in steps of k (128 bytes each): 8 KB.
constexpr int64_t kPanelAhead = 64;

inline void request_panel_row(const float* p) {
  const char* c = reinterpret_cast<const char*>(p);
  _mm_prefetch(c, _MM_HINT_T1);
  _mm_prefetch(c + 64, _MM_HINT_T1);
}

// y[0 .. MR, 0 .. 32] = x[0 .. MR, :] P^T for one panel p.
template <int MR>
void panel_tile(const float* p, int64_t k, const float* x, int64_t x_stride, float* y,
                int64_t y_stride) {
  __m512 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < k; ++t) {
    request_panel_row(p + (t + kPanelAhead) * kPanel);  // past the end: a hint, never a fault
    const __m512 w_lo = _mm512_loadu_ps(p + t * kPanel);
    const __m512 w_hi = _mm512_loadu_ps(p + t * kPanel + 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * x_stride + t]);
      lo[i] = _mm512_fmadd_ps(xv, w_lo, lo[i]);
      hi[i] = _mm512_fmadd_ps(xv, w_hi, hi[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(y + i * y_stride, lo[i]);
    _mm512_storeu_ps(y + i * y_stride + 16, hi[i]);
  }
}

// One row of x: two accumulators would be one FMA chain per vector, waiting on its own latency;
// four steps of k at a time keep eight chains going.
void panel_row(const float* p, int64_t k, const float* x, float* y) {
  __m512 acc[8];
  for (auto& a : acc) a = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 4 <= k; t += 4) {
    for (int u = 0; u < 4; ++u) {
      request_panel_row(p + (t + u + kPanelAhead) * kPanel);
      const __m512 xv = _mm512_set1_ps(x[t + u]);
      acc[2 * u] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(p + (t + u) * kPanel), acc[2 * u]);
      acc[2 * u + 1] =
          _mm512_fmadd_ps(xv, _mm512_loadu_ps(p + (t + u) * kPanel + 16), acc[2 * u + 1]);
    }
  }
  for (; t < k; ++t) {
    const __m512 xv = _mm512_set1_ps(x[t]);
    acc[0] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(p + t * kPanel), acc[0]);
    acc[1] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(p + t * kPanel + 16), acc[1]);
  }
  _mm512_storeu_ps(y, _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[4], acc[6])));
  _mm512_storeu_ps(y + 16,
                   _mm512_add_ps(_mm512_add_ps(acc[1], acc[3]), _mm512_add_ps(acc[5], acc[7])));
}

void panels_f32(const float* panels, int64_t num_panels, int64_t k, const float* x,
                int64_t x_stride, float* y, int64_t m) {
  const int64_t n = num_panels * kPanel;
  // Tiles of x as even as they can be: 13 rows run as 7 + 6, not 12 + 1.
  const int64_t tiles = (m + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* p = panels + j * k * kPanel;
      float* yj = y + j * kPanel;
      if (m == 1) {
        panel_row(p, k, x, yj);
        continue;
      }
      int64_t m0 = 0;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t rows = (m - m0) / (tiles - tile);
        const float* xt = x + m0 * x_stride;
        float* yt = yj + m0 * n;
        switch (rows) {
#define JETSERVE_PANEL_TILE(R) \
  case R: panel_tile<R>(p, k, xt, x_stride, yt, n); break;
          JETSERVE_PANEL_TILE(1) JETSERVE_PANEL_TILE(2) JETSERVE_PANEL_TILE(3)
          JETSERVE_PANEL_TILE(4) JETSERVE_PANEL_TILE(5) JETSERVE_PANEL_TILE(6)
          JETSERVE_PANEL_TILE(7) JETSERVE_PANEL_TILE(8) JETSERVE_PANEL_TILE(9)
          JETSERVE_PANEL_TILE(10) JETSERVE_PANEL_TILE(11) JETSERVE_PANEL_TILE(12)
#undef JETSERVE_PANEL_TILE
          default: break;  // rows is 1 .. kPanelRows by construction
        }
        m0 += rows;
      }
    }
  });
}

template <Format F>
void skinny(const Weight& w, const float* x, int64_t x_stride, float* y, int64_t m) {
  at::parallel_for(0, w.n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(4 * w.k);
    int64_t n = begin;
    if (m == 1) {  // a single row of x: eight weight rows at a time for eight FMA chains
      for (; n + 8 <= end; n += 8)
        tile<F, 1, 8>(w, x, x_stride, y, w.n, 0, n, Ahead<F, 8>{&w, std::min(n + 8, end - 8)});
    }
    for (; n + 4 <= end; n += 4) column_tile<F, 4>(w, x, x_stride, y, m, n, scratch.data());
    for (; n < end; ++n) column_tile<F, 1>(w, x, x_stride, y, m, n, scratch.data());
  });
}
#endif

// Portable path (no AVX-512): dequantize a group, then plain loops the compiler vectorizes.
void skinny_portable(const Weight& w, const float* x, int64_t x_stride, float* y, int64_t m) {
  at::parallel_for(0, w.n, 64, [&](int64_t begin, int64_t end) {
    float group[kGroup];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t i = 0; i < m; ++i) y[i * w.n + n] = 0.0f;
      for (int64_t g = 0; g < w.k / kGroup; ++g) {
        w.dequant(n, g, group);
        for (int64_t i = 0; i < m; ++i) {
          const float* xr = x + i * x_stride + g * kGroup;
          float dot = 0.0f;
          for (int t = 0; t < kGroup; ++t) dot += xr[t] * group[t];
          y[i * w.n + n] += dot;
        }
      }
    }
  });
}

#if !defined(__AVX512F__)
void panels_f32(const float* panels, int64_t num_panels, int64_t k, const float* x,
                int64_t x_stride, float* y, int64_t m) {
  const int64_t n = num_panels * kPanel;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* p = panels + j * k * kPanel;
      for (int64_t i = 0; i < m; ++i) {
        float acc[kPanel] = {};
        for (int64_t t = 0; t < k; ++t) {
          const float xv = x[i * x_stride + t];
          for (int c = 0; c < kPanel; ++c) acc[c] += xv * p[t * kPanel + c];
        }
        for (int c = 0; c < kPanel; ++c) y[i * n + j * kPanel + c] = acc[c];
      }
    }
  });
}
#endif

void check_x(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "linear: x must be fp32 [M, K] with contiguous rows");
  TORCH_CHECK(x.size(1) == k, "linear: x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(k % kGroup == 0, "linear: K must be a multiple of ", kGroup);
}

torch::Tensor run_skinny(const Weight& w, const torch::Tensor& x) {
  const int64_t m = x.size(0);
  auto y = torch::empty({m, w.n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX512F__)
  switch (w.format) {
    case Format::F32: TORCH_CHECK(false, "fp32 weights run as panels (linear_f32)"); break;
    case Format::Int8: skinny<Format::Int8>(w, xp, x.stride(0), yp, m); break;
    case Format::Int4: skinny<Format::Int4>(w, xp, x.stride(0), yp, m); break;
  }
#else
  skinny_portable(w, xp, x.stride(0), yp, m);
#endif
  return y;
}

void dequant_rows(const Weight& w, int64_t begin, int64_t end, float* out) {
  for (int64_t r = begin; r < end; ++r) {
    float* row = out + (r - begin) * w.k;
    for (int64_t g = 0; g < w.k / kGroup; ++g) {
#if defined(__AVX512F__)
      __m512 lo, hi;
      switch (w.format) {
        case Format::F32: load_group<Format::F32>(w, r, g, lo, hi); break;
        case Format::Int8: load_group<Format::Int8>(w, r, g, lo, hi); break;
        case Format::Int4: load_group<Format::Int4>(w, r, g, lo, hi); break;
      }
      _mm512_storeu_ps(row + g * kGroup, lo);
      _mm512_storeu_ps(row + g * kGroup + 16, hi);
#else
      w.dequant(r, g, row + g * kGroup);
#endif
    }
  }
}

// Many rows: dequantize W a block of rows at a time and let BLAS multiply, in fp32 or, with
// `bf16`, in bfloat16 with fp32 accumulation (several times faster where the CPU has AMX).
torch::Tensor run_blas(const Weight& w, const torch::Tensor& x, bool bf16) {
  constexpr int64_t kBlockRows = 512;
  const int64_t m = x.size(0);
  auto y = torch::empty({m, w.n}, x.options());
  auto block = torch::empty({std::min(kBlockRows, w.n), w.k}, x.options());
  float* bp = block.data_ptr<float>();
  const auto xb = bf16 ? x.to(torch::kBFloat16) : x;
  for (int64_t n0 = 0; n0 < w.n; n0 += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, w.n - n0);
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      dequant_rows(w, n0 + begin, n0 + end, bp + begin * w.k);
    });
    auto w_block = block.narrow(0, 0, rows);
    y.narrow(1, n0, rows).copy_(bf16 ? torch::mm(xb, w_block.to(torch::kBFloat16).t())
                                     : torch::mm(x, w_block.t()));
  }
  return y;
}

torch::Tensor run(const Weight& w, const torch::Tensor& x, int64_t skinny_max_rows, bool bf16) {
  return x.size(0) <= skinny_max_rows ? run_skinny(w, x) : run_blas(w, x, bf16);
}

}  // namespace

torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& panels) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
              panels.scalar_type() == torch::kFloat32,
              "linear_f32: the weight must be fp32 panels [N / ", kPanel, ", K, ", kPanel, "]");
  const int64_t k = panels.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "linear_f32: x must be fp32 [M, K] with contiguous rows");
  TORCH_CHECK(x.size(1) == k, "linear_f32: x has ", x.size(1), " columns, the weight ", k);
  const int64_t m = x.size(0);
  auto y = torch::empty({m, panels.size(0) * kPanel}, x.options());
  if (m > 0)
    panels_f32(panels.data_ptr<float>(), panels.size(0), k, x.data_ptr<float>(), x.stride(0),
               y.data_ptr<float>(), m);
  return y;
}

torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          int64_t skinny_max_rows, bool bf16) {
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == torch::kInt8, "linear_int8: q must be int8");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == torch::kFloat32 &&
              scale.numel() == q.numel() / kGroup, "linear_int8: one fp32 scale per 32 weights");
  check_x(x, q.size(1));
  Weight w{Format::Int8, q.size(0), q.size(1)};
  w.q8 = q.data_ptr<int8_t>();
  w.scale = scale.data_ptr<float>();
  return run(w, x, skinny_max_rows, bf16);
}

torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& min, int64_t skinny_max_rows, bool bf16) {
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == torch::kUInt8, "linear_int4: q must be uint8");
  const int64_t k = q.size(1) * 2;
  TORCH_CHECK(scale.is_contiguous() && min.is_contiguous() &&
              scale.scalar_type() == torch::kFloat32 && min.scalar_type() == torch::kFloat32 &&
              scale.numel() == q.size(0) * k / kGroup && min.numel() == scale.numel(),
              "linear_int4: one fp32 scale and min per 32 weights");
  check_x(x, k);
  Weight w{Format::Int4, q.size(0), k};
  w.q4 = q.data_ptr<uint8_t>();
  w.scale = scale.data_ptr<float>();
  w.min = min.data_ptr<float>();
  return run(w, x, skinny_max_rows, bf16);
}
