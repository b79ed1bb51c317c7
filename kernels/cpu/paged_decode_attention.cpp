// Decode attention straight from the paged KV cache, for the CPU (fp32).
//
// Each query head is scored against every cached key of its KV head, then the softmax weights
// accumulate the values. With AVX-512 (head_dim 64 or 128), 16 positions' scores are summed in
// one transposing tree and the exponentials are vectorized; otherwise plain loops. Keys and values are read in place through the block table: nothing is
// gathered into a contiguous copy first, so each byte of the cache crosses the memory bus once
// per step instead of three times.

#include "ops.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
namespace {

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

// One query head of one sequence, head_dim = 16 * DV. `scores` holds at least len + 16 floats.
template <int DV>
void decode_head(const float* q, const float* k_ptr, const float* v_ptr, const int32_t* table,
                 int64_t len, int64_t block_size, int64_t token_stride, float scale, float* scores,
                 float* out) {
  __m512 qv[DV];
  for (int d = 0; d < DV; ++d) qv[d] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * d), _mm512_set1_ps(scale));
  auto row = [&](const float* base, int64_t pos) {
    return base + (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) *
                      token_stride;
  };
  __m512 peak = _mm512_set1_ps(-INFINITY);
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - p0));
    __m512 partial[16];
    for (int i = 0; i < 16; ++i) {
      partial[i] = _mm512_setzero_ps();
      if (i < n) {
        const float* key = row(k_ptr, p0 + i);
        for (int d = 0; d < DV; ++d)
          partial[i] = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(key + 16 * d), partial[i]);
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    const __m512 s = sum16(partial);
    _mm512_mask_storeu_ps(scores + p0, valid, s);
    peak = _mm512_mask_max_ps(peak, valid, peak, s);
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 total = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - p0));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + p0), top));
    _mm512_mask_storeu_ps(scores + p0, valid, e);
    total = _mm512_mask_add_ps(total, valid, total, e);
  }
  // Two sets of accumulators (even and odd positions) so the FMA chains overlap.
  __m512 acc[2][DV];
  for (int j = 0; j < 2; ++j)
    for (int d = 0; d < DV; ++d) acc[j][d] = _mm512_setzero_ps();
  for (int64_t pos = 0; pos < len; ++pos) {
    const __m512 w = _mm512_set1_ps(scores[pos]);
    const float* value = row(v_ptr, pos);
    for (int d = 0; d < DV; ++d)
      acc[pos & 1][d] = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 16 * d), acc[pos & 1][d]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int d = 0; d < DV; ++d)
    _mm512_storeu_ps(out + 16 * d, _mm512_mul_ps(_mm512_add_ps(acc[0][d], acc[1][d]), inv));
}

}  // namespace
#endif

void paged_decode_attention(
    const torch::Tensor& q,             // [num_tokens, num_heads, head_dim], rows may be strided
    const torch::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const torch::Tensor& v_cache,       // same
    const torch::Tensor& block_tables,  // int32 [num_seqs, max_blocks]
    const torch::Tensor& seq_lens,      // int32 [num_seqs], keys to attend, the new one included
    const torch::Tensor& q_rows,        // int64 [num_seqs], the row of q holding each query
    torch::Tensor& out,                 // [num_tokens, num_heads, head_dim]
    double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: fp32 only");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q: heads must be packed");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
              block_tables.is_contiguous(), "cache, out and block_tables must be contiguous");
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t group = num_heads / k_cache.size(2);  // query heads per KV head
  const int64_t max_blocks = block_tables.size(1);

  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0);  // q is usually a view into the fused QKV output
  const int64_t token_stride = k_cache.size(2) * head_dim;  // between positions in a block
  const float fscale = static_cast<float>(scale);

#if defined(__AVX512F__)
  if (head_dim == 64 || head_dim == 128) {
    // One task per (sequence, query head): even work for few long sequences too.
    const int64_t max_len = num_seqs ? seq_lens.max().item<int32_t>() : 0;
    at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(max_len + 16);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / num_heads, h = task % num_heads;
        const float* qh = q_ptr + rows[seq] * q_stride + h * head_dim;
        const int64_t kv_offset = (h / group) * head_dim;
        float* o = out_ptr + rows[seq] * num_heads * head_dim + h * head_dim;
        const int32_t* table = tables + seq * max_blocks;
        if (head_dim == 64)
          decode_head<4>(qh, k_ptr + kv_offset, v_ptr + kv_offset, table, lens[seq], block_size,
                         token_stride, fscale, scores.data(), o);
        else
          decode_head<8>(qh, k_ptr + kv_offset, v_ptr + kv_offset, table, lens[seq], block_size,
                         token_stride, fscale, scores.data(), o);
      }
    });
    return;
  }
#endif

  // One task per sequence: a cached token's keys for all KV heads are one contiguous row, read
  // once for all query heads.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> query(num_heads * head_dim);
    std::vector<float> acc(num_heads * head_dim);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      const float* q_row = q_ptr + rows[seq] * q_stride;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) query[i] = q_row[i] * fscale;
      scores.resize(num_heads * len);

      for (int64_t pos = 0; pos < len; ++pos) {
        const float* keys = k_ptr + (static_cast<int64_t>(table[pos / block_size]) * block_size +
                                     pos % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* key = keys + (h / group) * head_dim;
          const float* qh = query.data() + h * head_dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * key[d];
          scores[h * len + pos] = dot;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * len;
        const float peak = *std::max_element(s, s + len);
        float total = 0.0f;
        for (int64_t pos = 0; pos < len; ++pos) {
          s[pos] = std::exp(s[pos] - peak);
          total += s[pos];
        }
        const float inv = 1.0f / total;
        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const float* values = v_ptr + (static_cast<int64_t>(table[pos / block_size]) * block_size +
                                       pos % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          const float w = scores[h * len + pos];
          const float* value = values + (h / group) * head_dim;
          float* a = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * value[d];
        }
      }
      float* o = out_ptr + rows[seq] * num_heads * head_dim;
      std::copy(acc.begin(), acc.end(), o);
    }
  });
}
