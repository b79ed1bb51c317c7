// Decode attention straight from the paged KV cache, for the CPU (fp32).
//
// Each query head is scored against every cached key of its KV head, then the softmax weights
// accumulate the values. Keys and values are read in place through the block table: nothing is
// gathered into a contiguous copy first, so each byte of the cache crosses the memory bus once
// per step instead of three times.

#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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
