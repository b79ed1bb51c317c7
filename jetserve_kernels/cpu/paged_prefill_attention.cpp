// Prefill attention straight from the paged KV cache, for the CPU (AVX-512; without it the
// torch backend runs SDPA over gathered blocks): each slice's new tokens against its cached
// context and themselves, causal, over an fp32, bf16 or int8 cache (jetserve_kernels/kv_int8.py).
//
// Flash-style tiles of 16 (token, query head) rows of one KV head, one row per vector lane, over
// 16 keys at a time with an online softmax. Scores come out transposed, one vector of the tile's
// rows per key, so the softmax's maxima and sums run across vectors and no horizontal sum is
// needed; the keys and values are read once per tile through the block table, nothing gathered.

#include "ops.h"
#include "attention_simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX512F__)
namespace {

using namespace paged;

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

// Rows [r0, r0 + 16) of a slice's (token, head) rows, r = token * group + head, for one KV head:
// flash-style over keys [0, last query position] read through the block table, 16 at a time,
// with an online softmax. A row is a vector lane: the query tile is transposed once, each key's
// values are broadcast against it, and the scores of one key for all 16 rows form one vector.
// q and out point at the slice's first token and the KV head's first query head.
template <typename T, int DV>
void prefill_tile(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t r0,
                  int64_t num_rows, int64_t group, int64_t first_pos, float scale,
                  RowCursor keys, RowCursor values) {
  constexpr int D = 16 * DV;
  const int live = static_cast<int>(std::min<int64_t>(16, num_rows - r0));
  alignas(64) float qt[D][16];   // the tile's queries, transposed and scaled
  alignas(64) float ot[D][16];   // its outputs, transposed
  alignas(64) float kbuf[16][D];
  alignas(64) float vbuf[16][D];
  alignas(64) float lane_pos[16];
  for (int lane = 0; lane < 16; ++lane) {
    const int64_t r = r0 + std::min(lane, live - 1);  // spare lanes repeat the last row
    const float* src = q + (r / group) * q_stride + (r % group) * D;
    for (int d = 0; d < D; ++d) qt[d][lane] = src[d] * scale;
    lane_pos[lane] = static_cast<float>(first_pos + r / group);
  }
  for (int d = 0; d < D; ++d) _mm512_store_ps(ot[d], _mm512_setzero_ps());
  const __m512 pos = _mm512_load_ps(lane_pos);
  __m512 peak = _mm512_set1_ps(-1e30f), total = _mm512_setzero_ps();
  const int64_t num_keys = first_pos + (r0 + live - 1) / group + 1;
  for (int64_t c0 = 0; c0 < num_keys; c0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, num_keys - c0));
    load_chunk_rows<T, DV>(keys, n, kbuf);
    load_chunk_rows<T, DV>(values, n, vbuf);
    __m512 sc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) sc[j] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 qd = _mm512_load_ps(qt[d]);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) sc[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kbuf[j][d]), sc[j]);
    }
    // Key c0 + j is visible to lanes at or after its position (and exists: j < n).
    __m512 chunk_peak = _mm512_set1_ps(-1e30f);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const __mmask16 visible = j < n ? _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(c0 + j)), pos, _CMP_LE_OQ) : 0;
      sc[j] = _mm512_mask_blend_ps(visible, _mm512_set1_ps(-1e30f), sc[j]);
      chunk_peak = _mm512_max_ps(chunk_peak, sc[j]);
    }
    const __m512 new_peak = _mm512_max_ps(peak, chunk_peak);
    const __m512 alpha = exp_nonpositive(_mm512_sub_ps(peak, new_peak));
    peak = new_peak;
    total = _mm512_mul_ps(total, alpha);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      sc[j] = exp_nonpositive(_mm512_sub_ps(sc[j], new_peak));  // masked: e^-huge = 0
      total = _mm512_add_ps(total, sc[j]);
    }
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m512 o[8];
#pragma GCC unroll 8
      for (int dd = 0; dd < 8; ++dd) o[dd] = _mm512_mul_ps(_mm512_load_ps(ot[d0 + dd]), alpha);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
#pragma GCC unroll 8
        for (int dd = 0; dd < 8; ++dd)
          o[dd] = _mm512_fmadd_ps(sc[j], _mm512_set1_ps(vbuf[j][d0 + dd]), o[dd]);
#pragma GCC unroll 8
      for (int dd = 0; dd < 8; ++dd) _mm512_store_ps(ot[d0 + dd], o[dd]);
    }
  }
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
  for (int lane = 0; lane < live; ++lane) {
    const int64_t r = r0 + lane;
    float* dst = out + (r / group) * out_stride + (r % group) * D;
    for (int d = 0; d < D; ++d) dst[d] = ot[d][lane] * inv[lane];
  }
}

}  // namespace
#endif

void paged_prefill_attention(
    const torch::Tensor& q,            // [num_tokens, num_heads, head_dim], rows may be strided
    const torch::Tensor& k_cache,      // as paged_decode_attention's, the new keys written already
    const torch::Tensor& v_cache,
    const torch::Tensor& block_table,  // int32 [blocks], the slice's sequence
    int64_t q_start, int64_t q_len,    // the slice's rows of q and out
    int64_t first_pos,                 // the position of its first token (cached tokens before)
    torch::Tensor& out,                // [num_tokens, num_heads, head_dim]
    double scale) {
  const paged::Rows kind =
      paged::check_attention_args("paged_prefill_attention", q, k_cache, v_cache, out, block_table);
  const paged::SliceView s(q, k_cache, v_cache, block_table, out, scale);
  paged::check_slice("paged_prefill_attention", q, out, block_table, s.block_size, q_start, q_len,
                     first_pos);
#if defined(__AVX512F__)
  TORCH_CHECK(s.head_dim == 64 || s.head_dim == 128,
              "paged_prefill_attention: head_dim 64 or 128, not ", s.head_dim);
  const int64_t num_rows = q_len * s.group, tiles = (num_rows + 15) / 16;
  // Later tiles attend to more keys: tasks alternate between the first and the last tiles, so
  // the contiguous ranges parallel_for hands each thread carry equal work.
  at::parallel_for(0, tiles * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task % s.num_kv_heads, i = task / s.num_kv_heads;
      const int64_t tile = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
      const float* qs = s.q + q_start * s.q_stride + kv * s.group * s.head_dim;
      float* o = s.out + q_start * s.out_stride + kv * s.group * s.head_dim;
      const RowCursor keys{s.k + kv * s.row_bytes, s.table, s.block_size, s.token_stride};
      const RowCursor values{s.v + kv * s.row_bytes, s.table, s.block_size, s.token_stride};
      auto run = [&](auto tile_fn) {
        tile_fn(qs, s.q_stride, o, s.out_stride, tile * 16, num_rows, s.group, first_pos, s.scale,
                keys, values);
      };
      const bool d64 = s.head_dim == 64;
      if (kind == paged::Rows::Int8) run(d64 ? prefill_tile<int8_t, 4> : prefill_tile<int8_t, 8>);
      else if (kind == paged::Rows::BF16)
        run(d64 ? prefill_tile<c10::BFloat16, 4> : prefill_tile<c10::BFloat16, 8>);
      else run(d64 ? prefill_tile<float, 4> : prefill_tile<float, 8>);
    }
  });
#else
  TORCH_CHECK(false, "paged_prefill_attention needs AVX-512 (the torch backend uses SDPA)");
#endif
}

bool prefill_attention_kernel() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

