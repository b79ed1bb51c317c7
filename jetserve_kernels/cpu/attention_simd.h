// What the paged attention kernels share: their argument checks, the int8 row layout, a walk
// over a sequence's cache rows through its block table, and vector helpers. AVX-512 builds: a
// fast e^x for softmax, 16-way horizontal sums, a 16 x 16 transpose, reads of fp32, bf16 or int8
// cache rows, and the order of arithmetic that makes prefill and decode attention agree to the
// bit. AVX2 builds: the same e^x 8 lanes at a time, and bf16 and int8 rows widened to fp32.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace paged {

// An int8 cache row (jetserve_kernels/kv_int8.py): head_dim int8 codes, then for each group of
// kInt8Group of them (the whole row under that) an fp16 scale and an fp16 offset;
// value = scale * code + offset.
constexpr int64_t kInt8Group = 32;
inline int64_t int8_group(int64_t head_dim) {
  return head_dim < kInt8Group ? head_dim : kInt8Group;
}
inline int64_t int8_row_bytes(int64_t head_dim) {
  return head_dim + head_dim / int8_group(head_dim) * 4;
}
inline int64_t int8_head_dim(int64_t row_bytes) {
  return row_bytes < kInt8Group + 4 ? row_bytes - 4 : row_bytes * kInt8Group / (kInt8Group + 4);
}

inline float half_at(const char* p) {
  c10::Half h;
  std::memcpy(&h.x, p, sizeof h.x);
  return static_cast<float>(h);
}
// Group g's scale and offset in a row of head_dim codes.
inline float group_scale(const char* row, int64_t head_dim, int64_t g) {
  return half_at(row + head_dim + 4 * g);
}
inline float group_offset(const char* row, int64_t head_dim, int64_t g) {
  return half_at(row + head_dim + 4 * g + 2);
}

// A cache's kind of row: fp32, bf16 (head_dim values each) or int8 (codes, scales, offsets).
enum class Rows { F32, BF16, Int8 };

// The checks both kernels make of their tensors; the cache's kind of row.
inline Rows check_attention_args(const char* op, const torch::Tensor& q,
                                 const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& out, const torch::Tensor& block_table) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && out.size(1) == q.size(1) &&
              out.size(2) == q.size(2) && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              k_cache.size(1) > 0 && k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0, op,
              ": q and out [tokens, heads, head_dim], the caches [blocks, block_size, kv_heads, "
              "row] with heads a multiple of kv_heads");
  const auto type = k_cache.scalar_type();
  const Rows kind = type == torch::kInt8 ? Rows::Int8
                    : type == torch::kBFloat16 ? Rows::BF16 : Rows::F32;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 &&
              (kind != Rows::F32 || type == torch::kFloat32) &&
              v_cache.scalar_type() == type,
              op, ": fp32 queries over an fp32, bf16 or int8 cache");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), op, ": q's heads must be packed");
  // A block table's rows are contiguous; they may repeat one row (stride 0: a prefill's tokens
  // run as decodes of one sequence).
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
              block_table.stride(-1) == 1 && block_table.scalar_type() == torch::kInt32, op,
              ": cache and out must be contiguous, block tables int32 with contiguous rows");
  const bool int8 = kind == Rows::Int8;
  TORCH_CHECK(q.size(2) > 0 && k_cache.size(3) == (int8 ? int8_row_bytes(q.size(2)) : q.size(2)) &&
              (!int8 || q.size(2) % int8_group(q.size(2)) == 0), op, ": cache rows of ",
              k_cache.size(3), " for head_dim ", q.size(2));
  return kind;
}

// A prefill slice's checks: rows [q_start, q_start + q_len) of q and out, and a block table of
// one sequence covering positions [0, first_pos + q_len).
inline void check_slice(const char* op, const torch::Tensor& q, const torch::Tensor& out,
                        const torch::Tensor& block_table, int64_t block_size, int64_t q_start,
                        int64_t q_len, int64_t first_pos) {
  TORCH_CHECK(q_start >= 0 && q_len >= 0 && q_start + q_len <= q.size(0) &&
              q_start + q_len <= out.size(0), op, ": rows [", q_start, ", ", q_start + q_len,
              ") are not rows of q and out");
  TORCH_CHECK(block_table.dim() == 1 && first_pos >= 0 &&
              block_table.size(0) * block_size >= first_pos + q_len, op,
              ": the block table must cover positions [0, ", first_pos + q_len, ")");
}

// What the prefill kernels read of their tensors (checked first): the data, strides (q and out
// in floats, cache rows in bytes) and the heads' layout.
struct SliceView {
  const float* q;
  float* out;
  const char* k;
  const char* v;
  const int32_t* table;
  int64_t q_stride, out_stride, row_bytes, token_stride;
  int64_t num_heads, head_dim, block_size, num_kv_heads, group;
  float scale;

  SliceView(const torch::Tensor& q_, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_table, torch::Tensor& out_, double scale_)
      : q(q_.data_ptr<float>()), out(out_.data_ptr<float>()),
        k(static_cast<const char*>(k_cache.data_ptr())),
        v(static_cast<const char*>(v_cache.data_ptr())), table(block_table.data_ptr<int32_t>()),
        q_stride(q_.stride(0)), out_stride(q_.size(1) * q_.size(2)),
        row_bytes(k_cache.size(3) * k_cache.element_size()),
        token_stride(k_cache.size(2) * k_cache.size(3) * k_cache.element_size()),
        num_heads(q_.size(1)), head_dim(q_.size(2)), block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)), group(q_.size(1) / k_cache.size(2)),
        scale(static_cast<float>(scale_)) {}
};

// Walks a sequence's positions block by block: the cache row of each position without a
// division per position. Strides in bytes.
struct RowCursor {
  const char* base;
  const int32_t* table;
  int64_t block_size, token_stride, block = 0, offset = 0;

  const char* next() {
    const char* row =
        base + (static_cast<int64_t>(table[block]) * block_size + offset) * token_stride;
    if (++offset == block_size) offset = 0, ++block;
    return row;
  }
};

// One cache value as fp32, for the portable paths.
inline float bf16_at(const char* p) {
  c10::BFloat16 b;
  std::memcpy(&b.x, p, sizeof b.x);
  return static_cast<float>(b);
}

}  // namespace paged

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace paged {

// e^x for x <= 0, as exp_nonpositive on AVX-512 below: 2^n * 2^f, 2^f from its Taylor series to
// the 6th power.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 g = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718f));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// A bf16 or int8 cache row's head_dim values (a multiple of 16) as fp32 into dst, 8 at a time:
// bf16 as the high half of an fp32, int8 codes times their group's scale plus its offset.
inline void widen_row8(Rows kind, const char* row, int64_t head_dim, float* dst) {
  if (kind == Rows::BF16) {
    for (int64_t d = 0; d < head_dim; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d))),
                                16)));
    return;
  }
  const int64_t size = int8_group(head_dim);
  for (int64_t g = 0; g < head_dim / size; ++g) {
    const __m256 scale = _mm256_set1_ps(group_scale(row, head_dim, g));
    const __m256 offset = _mm256_set1_ps(group_offset(row, head_dim, g));
    for (int64_t d = g * size; d < (g + 1) * size; d += 8) {
      const __m256i codes = _mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
      _mm256_storeu_ps(dst + d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), scale, offset));
    }
  }
}

}  // namespace paged
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16_simd.h"

namespace paged {

// e^x for x <= 0 (scores minus their max): 2^(x log2 e) as 2^n * 2^f, with 2^f = e^(f ln 2) from
// its Taylor series to the 6th power (|f ln 2| <= 0.35: relative error under 1e-7).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 g = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The 16 horizontal sums of v[0..16) as one vector (element i = sum of v[i]): a transposing
// tree of 15 adds instead of 16 separate reductions.
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per lane: the lane sums of v[4i .. 4i+4)
    const __m512d c = _mm512_castps_pd(t[2 * i]), d = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// Transposes 16 vectors of 16: out[l]'s lane i is in[i * stride]'s lane l (four rounds of
// unpacks and 128-bit shuffles; out must not overlap in).
inline void transpose16(const __m512* in, int64_t stride, __m512* out) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: columns 4L, 4L+1 (lo) and 4L+2, 4L+3 (hi)
    t[2 * i] = _mm512_unpacklo_ps(in[2 * i * stride], in[(2 * i + 1) * stride]);
    t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i * stride], in[(2 * i + 1) * stride]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], lane L: column 4L + c of rows 4i .. 4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]),
                  c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {  // the four 128-bit lanes of rows 0-3, 4-7, 8-11, 12-15
    const __m512 v = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 w2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    out[c] = _mm512_shuffle_f32x4(v, v2, 0x88);
    out[4 + c] = _mm512_shuffle_f32x4(w, w2, 0x88);
    out[8 + c] = _mm512_shuffle_f32x4(v, v2, 0xDD);
    out[12 + c] = _mm512_shuffle_f32x4(w, w2, 0xDD);
  }
}

// The sum of a vector's 16 lanes in one fixed tree (lane i with i^8, then i^4, i^2, i^1): the
// attention kernels sum a softmax's lane totals through this alone, so they agree to the bit.
inline float lane_sum(__m512 v) {
  const __m512 a = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  const __m512 b = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0xB1));
  const __m512 c = _mm512_add_ps(b, _mm512_permute_ps(b, 0x4E));
  const __m512 d = _mm512_add_ps(c, _mm512_permute_ps(c, 0xB1));
  return _mm512_cvtss_f32(d);
}

// 1 / x, rounded once (a division written as `1.0f / x` may become an approximate reciprocal
// under -ffast-math once the compiler vectorizes it; this one stays a single divss).
inline float reciprocal(float x) { return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.0f), _mm_set_ss(x))); }

// --- The batch-invariant order -----------------------------------------------------------
//
// In this order a (token, query head) attends to positions [0, len) of its KV head the same
// way in both kernels asked for it (`invariant`): the prefill tiles (paged_prefill_attention.cpp,
// which keep it for every model but for the bf16 products below) and the decode kernel, so that
// a prefill's token gets the bits it gets as a decode (a batch-invariant model):
//   q' = q * scale, element by element (scaled_query);
//   score[p] = one fused multiply-add chain over d = 0 .. head_dim - 1, from 0:
//              s = q'[d] k[p][d] + s;
//   e[p] = exp_nonpositive(score[p] - the largest score);
//   total = lane_sum of 16 partial sums, partial j adding e[p] for p = j, j + 16, ... in order;
//   out[d] = (a chain over p in order, from 0: acc = e[p] v[p][d] + acc) * reciprocal(total).
// A tile scores with one (token, head) row per lane and one key per multiply-add; the decode
// kernel transposes 16 keys (element d of each in one vector) to make the same chains.
//
// Asked for it, over a bf16 or int8 cache, where the CPU has AVX512-BF16 (and AVX512-VNNI, which
// every such CPU has: `bf16_products`), the products are bf16 dot products (vdpbf16ps: twice the
// products of an FMA), and so q' and the weights are rounded to bf16 (nearest, ties to even)
// first; the keys and values of a bf16 cache are bf16 already, an int8 cache's values are
// dequantized as load_row does it, scale * code + offset in one fused multiply-add, then rounded
// to bf16 the same way:
//   score[p] = one chain over the pairs d = (0, 1), (2, 3), ... from 0: s = dot_pairs(s, q', k);
//   e[p] = bf16(exp_nonpositive(score[p] - the largest score)), the total summing these;
//   out[d] = (a chain over the pairs of positions (0, 1), (2, 3), ... from 0:
//             acc = dot_pairs(acc, (e[p], e[p + 1]), (v[p][d], v[p + 1][d]))) * reciprocal(total);
//   a position past those attended to weighs 0 against a value of 0 or a cached one.
// (The sum in a lane is the instruction's; both kernels hand it the same pairs in the same
// halves.) The same bits assume finite cached values (0 times a later token's infinite value
// would be NaN in a tile, 0 in a decode: a model that overflowed), and a zero output may
// differ in its sign (vdpbf16ps flushes tiny sums to zero), which no later sum can tell.
//
// An int8 cache's keys are not rounded to bf16: each query is, instead, put in 16-bit codes
// (query_codes: unit = max |q'| / 32767, code = q' / unit rounded to nearest even), and the
// products with the keys' int8 codes are integers (vpdpwssd: 32 products of 16-bit pairs into 16
// int32 sums, exact, in any order), one sum I[g] a group of 32 channels, and Q[g] the sum of the
// query's codes there:
//   score[p] = (a chain over the groups g in order, from 0:
//               s = fma(float(I[g]), scale[p][g], s); s = fma(float(Q[g]), offset[p][g], s))
//              * unit.
// That is q' . k to fp32's precision for the query in 16-bit codes (15 bits and a sign, where
// bf16 keeps 8) against the key exactly as cached, where rounding both to bf16 added its own
// error to the int8 step's; and a decode reads a key row's codes in one widening instruction a
// group instead of dequantizing and rounding them (BENCHMARKS.md, "Integer products for int8
// keys").
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PAGED_BF16_PRODUCTS 1
constexpr bool kBf16Products = true;
#else
constexpr bool kBf16Products = false;
#endif
template <typename T>
constexpr bool bf16_products =
    kBf16Products && (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, int8_t>);

// One query head's 16 * DV values times the scale, into qs.
template <int DV>
inline void scaled_query(const float* q, float scale, float* qs) {
  for (int d = 0; d < DV; ++d)
    _mm512_storeu_ps(qs + 16 * d,
                     _mm512_mul_ps(_mm512_loadu_ps(q + 16 * d), _mm512_set1_ps(scale)));
}

// A cache row's 16 * DV values as fp32 into v: an fp32 row as it is, a bf16 row widened, an int8
// row's codes times their group's scale plus its offset (two vectors of 16 to a group).
template <typename T, int DV>
inline void load_row(const char* row, __m512* v) {
  if constexpr (std::is_same_v<T, float>) {
    const float* f = reinterpret_cast<const float*>(row);
    for (int d = 0; d < DV; ++d) v[d] = _mm512_loadu_ps(f + 16 * d);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the high half of an fp32
    for (int d = 0; d < DV; ++d)
      v[d] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * d))),
          16));
  } else {
    constexpr int kHeadDim = 16 * DV;
    for (int g = 0; g < DV / 2; ++g) {
      const __m512 scale = _mm512_set1_ps(group_scale(row, kHeadDim, g));
      const __m512 offset = _mm512_set1_ps(group_offset(row, kHeadDim, g));
      for (int d = 2 * g; d < 2 * g + 2; ++d)
        v[d] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(row + 16 * d)))),
                               scale, offset);
    }
  }
}

#if defined(PAGED_BF16_PRODUCTS)
// Lane i of v[d]: the pair (a's element 16 d + i, b's) in bf16, for the value sums with bf16
// products: a bf16 row's elements as they are, an int8 row's dequantized (load_row) and rounded.
template <typename T, int DV>
inline void value_pairs(const char* a, const char* b, __m512i* v) {
  static_assert(bf16_products<T>);
  if constexpr (std::is_same_v<T, int8_t>) {
    __m512 va[DV], vb[DV];
    load_row<T, DV>(a, va);
    load_row<T, DV>(b, vb);
    for (int d = 0; d < DV; ++d) v[d] = bf16_pairs(va[d], vb[d]);
  } else {
    for (int d = 0; d < DV; ++d) v[d] = interleave_bf16(a + 32 * d, b + 32 * d);
  }
}

// A bf16 key row's 16 * DV elements, in order (pairs of elements), into dst.
template <int DV>
inline void key_pairs(const char* row, uint16_t* dst) {
  for (int b = 0; b < DV / 2; ++b)
    _mm512_store_si512(dst + 32 * b, _mm512_loadu_si512(row + 64 * b));
}

// --- Integer key products over an int8 cache ----------------------------------------------

// a / b, rounded once (a division the compiler may not turn into a product by a reciprocal).
inline float quotient(float a, float b) {
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b)));
}

// A query row's 16 * DV scaled elements (q') in 16-bit codes: code = q' / unit rounded to nearest
// even, unit = max |q'| / 32767 (codes of 0 where max |q'| is under 1e-30, whose 32767 / max
// would overflow: a row of zeros, or one whose scores are 0 to fp32's precision anyway; the
// unit is computed all the same), written as pairs of codes into pairs[16 * DV / 2] (element 2i
// in the low half of pair i, as a key's pair), each group of 32's sum of codes into sums[], as
// fp32 (exactly: under 2^21). Returns the unit. Both kernels call
// this for every (token, query head), so a token gets the same codes in a prefill tile as in a
// decode.
template <int DV>
inline float query_codes(const float* qs, uint32_t* pairs, float* sums) {
  __m512 peak = _mm512_setzero_ps();
  for (int d = 0; d < DV; ++d)
    peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(qs + 16 * d)));
  const float top = _mm512_reduce_max_ps(peak);  // exact, in any order
  const __m512 per_unit = _mm512_set1_ps(top >= 1e-30f ? quotient(32767.0f, top) : 0.0f);
  for (int g = 0; g < DV / 2; ++g) {
    __m512i codes[2];
    for (int j = 0; j < 2; ++j)  // |q' / unit| <= 32767 (a NaN saturates below; an inf's code,
                                 // x * 0, too)
      codes[j] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qs + 32 * g + 16 * j), per_unit));
    const __m256i lo = _mm512_cvtsepi32_epi16(codes[0]), hi = _mm512_cvtsepi32_epi16(codes[1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 16 * g), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 16 * g + 8), hi);
    sums[g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(
        _mm512_cvtepi16_epi32(lo), _mm512_cvtepi16_epi32(hi))));
  }
  return quotient(top, 32767.0f);
}

// An int8 key row's codes as 16-bit pairs (32 codes, 16 pairs, a vector per group of 32) into
// dst, and each group's scale and offset into params[2 g], [2 g + 1], as fp32.
template <int DV>
inline void key_codes(const char* row, uint16_t* dst, float* params) {
  constexpr int D = 16 * DV;
  for (int g = 0; g < DV / 2; ++g) {
    _mm512_store_si512(dst + 32 * g, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(row + 32 * g))));
    params[2 * g] = group_scale(row, D, g);
    params[2 * g + 1] = group_offset(row, D, g);
  }
}

// acc + the products of a's and b's 16-bit pairs, lane by lane (vpdpwssd), written as an asm
// statement: GCC copied each accumulator of `_mm512_dpwssd_epi32` in a loop into another
// register and back around every instruction (no copies with the bf16 products' builtin), and
// its prefill tiles ran 1.15x the bf16 path's time.
inline __m512i dot_codes(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// One step of a score's chain over an int8 key's groups (the order above): s + I scale + Q offset.
inline __m512 add_group(__m512 s, __m512i sums, __m512 scale, __m512 query_sums, __m512 offset) {
  return _mm512_fmadd_ps(query_sums, offset, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, s));
}
#endif

// The next n rows of a cursor as fp32 (bf16 widened, int8 dequantized) into dst, zeros past them.
template <typename T, int DV>
inline void load_chunk_rows(RowCursor& cursor, int n, float (*dst)[16 * DV]) {
  for (int i = 0; i < n; ++i) {
    __m512 v[DV];
    load_row<T, DV>(cursor.next(), v);
    for (int d = 0; d < DV; ++d) _mm512_store_ps(dst[i] + 16 * d, v[d]);
  }
  for (int i = n; i < 16; ++i)
    for (int d = 0; d < DV; ++d) _mm512_store_ps(dst[i] + 16 * d, _mm512_setzero_ps());
}

// Asks for a cache row's lines, into L2, ahead of their use: rows are scattered over blocks, so
// the hardware prefetcher alone leaves the loads waiting on memory.
template <typename T, int DV>
inline void prefetch_row(const char* row) {
  constexpr int bytes = std::is_same_v<T, float> ? 64 * DV
                        : std::is_same_v<T, c10::BFloat16> ? 32 * DV : 16 * DV + 2 * DV;
  for (int c = 0; c < bytes; c += 64) _mm_prefetch(row + c, _MM_HINT_T1);
  if constexpr (bytes % 64 != 0) _mm_prefetch(row + bytes - 1, _MM_HINT_T1);
}

}  // namespace paged
#endif
