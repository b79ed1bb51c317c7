// Prefill attention straight from the paged KV cache, for the CPU (AVX-512, or AVX2 with FMA;
// without them the torch backend runs SDPA over gathered blocks): each slice's new tokens
// against its cached context and themselves, causal, over an fp32, bf16 or int8 cache
// (jetserve_kernels/kv_int8.py).
//
// AVX2 builds run tiles of 8 rows over 8 keys at a time in the same two passes (prefill_tile8),
// without the batch-invariant order below.
//
// AVX-512 builds: flash-style tiles of 16 (token, query head) rows of one KV head, one row per
// vector lane, over 16 keys at a time. Scores come out transposed, one vector of the tile's rows
// per key, so the softmax's maxima and sums run across vectors; the keys and values are read once
// per tile through the block table, nothing gathered. The arithmetic keeps the batch-invariant
// order (attention_simd.h): the decode kernel asked for that order gives each token the same
// bits. Asked for that order (`invariant`, a bf16 model's prefill) over a bf16 cache, where the
// CPU has AVX512-BF16, its products are bf16 dot products: the queries and weights in bf16 pairs
// against the keys' pairs of elements and the values' pairs of positions.

#include "ops.h"
#include "attention_simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
namespace {

using namespace paged;

// Rows [r0, r0 + 16) of a slice's (token, head) rows, r = token * group + head, for one KV head,
// over keys [0, last row's position]. q and out point at the slice's first token and the KV
// head's first query head. Two passes rather than an online softmax (which would rescale the
// sums as the maximum grows, in an order no decode keeps): first every key's scores, kept in
// `kept`, with each lane's maximum; then the exponentials, the lanes' 16 partial totals and the
// value sums, in position order (in pairs of positions with bf16 products: Pairs, over a bf16
// cache where the CPU has AVX512-BF16).
template <typename T, int DV, bool Pairs>
void prefill_tile(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t r0,
                  int64_t num_rows, int64_t group, int64_t first_pos, float scale, RowCursor keys,
                  RowCursor values, std::vector<__m512>& kept) {
  constexpr int D = 16 * DV;
  constexpr bool kPairs = Pairs && bf16_products<T>;
  const int live = static_cast<int>(std::min<int64_t>(16, num_rows - r0));
  __m512 rows[16][DV], qt[D];  // the tile's scaled queries; transposed, one vector per d
  alignas(64) float lane_pos[16];
  for (int lane = 0; lane < 16; ++lane) {
    const int64_t r = r0 + std::min(lane, live - 1);  // spare lanes repeat the last row
    scaled_query<DV>(q + (r / group) * q_stride + (r % group) * D, scale,
                     reinterpret_cast<float*>(rows[lane]));
    lane_pos[lane] = static_cast<float>(first_pos + r / group);
  }
  for (int b = 0; b < DV; ++b) transpose16(&rows[0][b], DV, qt + 16 * b);
  const __m512 pos = _mm512_load_ps(lane_pos);
  const int64_t all_see = first_pos + r0 / group;  // the keys every lane sees: [0, all_see]
  const int64_t num_keys = first_pos + (r0 + live - 1) / group + 1;
  kept.resize((num_keys + 15) / 16 * 16);
  // Which of 16 keys from c0 each lane sees (all of them, far enough back).
  auto seen = [&](int64_t c0, int n, int j) -> __mmask16 {
    if (j >= n) return 0;
    if (c0 + j <= all_see) return 0xFFFF;
    return _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(c0 + j)), pos, _CMP_LE_OQ);
  };

  // Scores, and each lane's largest.
  alignas(64) float buf[16][D];
  __m512 peak = _mm512_set1_ps(-INFINITY);
#if defined(__AVX512BF16__)
  // bf16 products: the scaled queries as bf16 pairs of elements; a chunk's keys (pairs of
  // elements) or values (pairs of rows).
  __m512i qp[kPairs ? D / 2 : 1];
  alignas(64) uint32_t pairs[kPairs ? 16 : 1][D];
  if constexpr (kPairs)
    for (int i = 0; i < D / 2; ++i) qp[i] = bf16_pairs(qt[2 * i], qt[2 * i + 1]);
#endif
  for (int64_t c0 = 0; c0 < num_keys; c0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, num_keys - c0));
    __m512 sc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) sc[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      load_chunk_raw<DV>(keys, n, pairs);
      for (int i = 0; i < D / 2; ++i) {
        const __m512i qi = qp[i];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
          sc[j] = dot_pairs(sc[j], qi, _mm512_set1_epi32(static_cast<int>(pairs[j][i])));
      }
    } else
#endif
    {
      load_chunk_rows<T, DV>(keys, n, buf);
      for (int d = 0; d < D; ++d) {
        const __m512 qd = qt[d];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
          sc[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(buf[j][d]), sc[j]);
      }
    }
    for (int j = 0; j < n; ++j) {
      kept[c0 + j] = sc[j];
      peak = _mm512_mask_max_ps(peak, seen(c0, n, j), peak, sc[j]);
    }
  }

  // Exponentials, their partial totals and the value sums, position by position.
  __m512 part[16], ot[D];
  for (int j = 0; j < 16; ++j) part[j] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) ot[d] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < num_keys; c0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, num_keys - c0));
    __m512 e[16];
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      // Weights rounded to bf16, zero where a lane does not see the key; values in pairs of
      // positions: pairs[m][d] = (v[2m][d], v[2m + 1][d]).
      load_chunk_pairs<DV>(values, n, pairs);
      __m512i ep[8];
      for (int j = 0; j < 16; ++j) {
        const __mmask16 sees = seen(c0, n, j);
        e[j] = bf16_rounded(_mm512_maskz_mov_ps(
            sees, exp_nonpositive(_mm512_sub_ps(j < n ? kept[c0 + j] : peak, peak))));
        part[j] = _mm512_mask_add_ps(part[j], sees, part[j], e[j]);
      }
      for (int m = 0; m < 8; ++m) ep[m] = bf16_pairs(e[2 * m], e[2 * m + 1]);
      const int live_pairs = (n + 1) / 2;
      for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 o[8];
#pragma GCC unroll 8
        for (int dd = 0; dd < 8; ++dd) o[dd] = ot[d0 + dd];
        for (int m = 0; m < live_pairs; ++m)
#pragma GCC unroll 8
          for (int dd = 0; dd < 8; ++dd)
            o[dd] = dot_pairs(o[dd], ep[m],
                              _mm512_set1_epi32(static_cast<int>(pairs[m][d0 + dd])));
#pragma GCC unroll 8
        for (int dd = 0; dd < 8; ++dd) ot[d0 + dd] = o[dd];
      }
      continue;
    }
#endif
    load_chunk_rows<T, DV>(values, n, buf);
    // Every lane sees every key (all chunks but the last few of a tile): unmasked, the same
    // sums as the masked loop below with all lanes set, which measured ~16% slower on
    // every chunk (2,048 tokens: 984 ms against 840).
    if (n == 16 && c0 + 15 <= all_see) {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        e[j] = exp_nonpositive(_mm512_sub_ps(kept[c0 + j], peak));
        // A masked add, as the decode's partials take (a plain vector add is open to
        // -ffast-math's reassociation, were this loop ever unrolled over positions).
        part[j] = _mm512_mask_add_ps(part[j], 0xFFFF, part[j], e[j]);
      }
      for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 o[8];
#pragma GCC unroll 8
        for (int dd = 0; dd < 8; ++dd) o[dd] = ot[d0 + dd];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
#pragma GCC unroll 8
          for (int dd = 0; dd < 8; ++dd)
            o[dd] = _mm512_fmadd_ps(e[j], _mm512_set1_ps(buf[j][d0 + dd]), o[dd]);
#pragma GCC unroll 8
        for (int dd = 0; dd < 8; ++dd) ot[d0 + dd] = o[dd];
      }
      continue;
    }
    __mmask16 sees[16];
    for (int j = 0; j < 16; ++j) {
      sees[j] = seen(c0, n, j);
      e[j] = exp_nonpositive(_mm512_sub_ps(j < n ? kept[c0 + j] : peak, peak));
      part[j] = _mm512_mask_add_ps(part[j], sees[j], part[j], e[j]);
    }
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m512 o[8];
      for (int dd = 0; dd < 8; ++dd) o[dd] = ot[d0 + dd];
      for (int j = 0; j < n; ++j)
        for (int dd = 0; dd < 8; ++dd)
          o[dd] = _mm512_mask3_fmadd_ps(e[j], _mm512_set1_ps(buf[j][d0 + dd]), o[dd], sees[j]);
      for (int dd = 0; dd < 8; ++dd) ot[d0 + dd] = o[dd];
    }
  }

  // Each lane's total from its 16 partials, then its outputs.
  __m512 partials[16];  // partials[lane]: that lane's 16 partial totals
  transpose16(part, 1, partials);
  __m512 outs[D];  // outs[16 * b + lane]: the lane's elements [16 b, 16 b + 16)
  for (int b = 0; b < DV; ++b) transpose16(ot + 16 * b, 1, outs + 16 * b);
  for (int lane = 0; lane < live; ++lane) {
    const int64_t r = r0 + lane;
    const __m512 inv = _mm512_set1_ps(reciprocal(lane_sum(partials[lane])));
    float* dst = out + (r / group) * out_stride + (r % group) * D;
    for (int b = 0; b < DV; ++b)
      _mm512_storeu_ps(dst + 16 * b, _mm512_mul_ps(outs[16 * b + lane], inv));
  }
}

}  // namespace
#elif defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace paged;

// The next n rows of a cursor as fp32: an fp32 cache's rows in place, bf16 and int8 rows widened
// into buf; past n, the last row again (its weight is 0, and its values are finite).
template <int D>
inline void chunk_rows8(RowCursor& cursor, int n, Rows kind, float (*buf)[D],
                        const float* rows[8]) {
  for (int j = 0; j < n; ++j) {
    const char* row = cursor.next();
    if (kind == Rows::F32) {
      rows[j] = reinterpret_cast<const float*>(row);
    } else {
      widen_row8(kind, row, D, buf[j]);
      rows[j] = buf[j];
    }
  }
  for (int j = n; j < 8; ++j) rows[j] = rows[n - 1];
}

// Transposes 8 vectors of 8 in place: v[i]'s lane l becomes v[l]'s lane i.
inline void transpose8(__m256 v[8]) {
  __m256 t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    v[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// AVX2 (8 lanes, 16 registers): rows [r0, r0 + 8) of a slice's (token, head) rows of one KV
// head over 8 keys at a time, in the AVX-512 tile's two passes. Scores: the scaled queries kept
// transposed (qt[d]: element d of the 8 rows), each key's element d broadcast against them, so a
// score is a chain of FMAs in one lane and no horizontal sum is taken; each lane's maximum.
// Then the exponentials (0 for a key a lane does not see), their totals, and the value sums row
// by row: a value row's 8 elements at a time against each row's weight broadcast. No
// batch-invariant order here: an AVX2 build has no bf16 products, and the engine asks for that
// order only with them.
template <int D>
void prefill_tile8(Rows kind, const float* q, int64_t q_stride, float* out, int64_t out_stride,
                   int64_t r0, int64_t num_rows, int64_t group, int64_t first_pos, float scale,
                   RowCursor keys, RowCursor values, std::vector<__m256>& kept) {
  const int live = static_cast<int>(std::min<int64_t>(8, num_rows - r0));
  alignas(32) float qt[D][8];
  alignas(32) float lane_pos[8];
  const float* src[8];
  for (int lane = 0; lane < 8; ++lane) {
    const int64_t r = r0 + std::min(lane, live - 1);  // spare lanes repeat the last row
    src[lane] = q + (r / group) * q_stride + (r % group) * D;
    lane_pos[lane] = static_cast<float>(first_pos + r / group);
  }
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int d = 0; d < D; d += 8) {
    __m256 block[8];
#pragma GCC unroll 8
    for (int lane = 0; lane < 8; ++lane)
      block[lane] = _mm256_mul_ps(_mm256_loadu_ps(src[lane] + d), scale8);
    transpose8(block);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) _mm256_store_ps(qt[d + i], block[i]);
  }
  const __m256 pos = _mm256_load_ps(lane_pos);
  const int64_t all_see = first_pos + r0 / group;  // the keys every lane sees: [0, all_see]
  const int64_t num_keys = first_pos + (r0 + live - 1) / group + 1;
  kept.resize((num_keys + 7) / 8 * 8);
  // All ones in the lanes that see key c0 + j.
  auto seen = [&](int64_t c0, int n, int j) -> __m256 {
    if (j >= n) return _mm256_setzero_ps();
    if (c0 + j <= all_see) return _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    return _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(c0 + j)), pos, _CMP_LE_OQ);
  };
  alignas(32) float buf[8][D];  // a chunk's bf16 or int8 rows, widened
  const float* rows[8];

  // Scores, and each lane's largest.
  const __m256 lowest = _mm256_set1_ps(-INFINITY);
  __m256 peak = lowest;
  for (int64_t c0 = 0; c0 < num_keys; c0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, num_keys - c0));
    chunk_rows8<D>(keys, n, kind, buf, rows);
    __m256 sc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) sc[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m256 qd = _mm256_load_ps(qt[d]);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        sc[j] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(rows[j] + d), sc[j]);
    }
    for (int j = 0; j < n; ++j) {
      kept[c0 + j] = sc[j];
      peak = _mm256_max_ps(peak, _mm256_blendv_ps(lowest, sc[j], seen(c0, n, j)));
    }
  }

  // Exponentials, their totals and the value sums: a row's sums in its own vectors (row-major),
  // a value row's 8 elements at a time against each row's weight broadcast.
  alignas(32) float acc[8][D] = {};
  alignas(32) float ew[8][8];  // ew[j][lane]: the lane's weight for key c0 + j
  __m256 total = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < num_keys; c0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, num_keys - c0));
    chunk_rows8<D>(values, n, kind, buf, rows);
    __m256 e[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      e[j] = _mm256_and_ps(seen(c0, n, j),
                           exp_nonpositive8(_mm256_sub_ps(j < n ? kept[c0 + j] : peak, peak)));
      _mm256_store_ps(ew[j], e[j]);
    }
    total = _mm256_add_ps(total, _mm256_add_ps(
        _mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3])),
        _mm256_add_ps(_mm256_add_ps(e[4], e[5]), _mm256_add_ps(e[6], e[7]))));
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 o[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) o[r] = _mm256_load_ps(acc[r] + d0);
      for (int j = 0; j < n; ++j) {
        const __m256 v = _mm256_loadu_ps(rows[j] + d0);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) o[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&ew[j][r]), v, o[r]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) _mm256_store_ps(acc[r] + d0, o[r]);
    }
  }

  alignas(32) float totals[8];
  _mm256_store_ps(totals, total);
  for (int lane = 0; lane < live; ++lane) {
    const int64_t r = r0 + lane;
    const __m256 inv = _mm256_set1_ps(1.0f / totals[lane]);
    float* dst = out + (r / group) * out_stride + (r % group) * D;
    for (int d = 0; d < D; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_load_ps(acc[lane] + d), inv));
  }
}

}  // namespace
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {

// Runs tile(q, q_stride, out, out_stride, first row, rows, group, first_pos, scale, keys, values,
// kept) for every task of a slice: each tile of `rows` (token, query head) rows of each KV head.
// Later tiles attend to more keys: tasks alternate between the first and the last tiles, so the
// contiguous ranges parallel_for hands each thread carry equal work.
template <typename Vector, typename Tile>
void for_each_tile(const paged::SliceView& s, int64_t q_start, int64_t q_len, int64_t first_pos,
                   int64_t rows, const Tile& tile) {
  const int64_t num_rows = q_len * s.group, tiles = (num_rows + rows - 1) / rows;
  at::parallel_for(0, tiles * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vector> kept;  // the scores of a tile
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task % s.num_kv_heads, i = task / s.num_kv_heads;
      const int64_t t = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
      tile(s.q + q_start * s.q_stride + kv * s.group * s.head_dim, s.q_stride,
           s.out + q_start * s.out_stride + kv * s.group * s.head_dim, s.out_stride, t * rows,
           num_rows, s.group, first_pos, s.scale,
           RowCursor{s.k + kv * s.row_bytes, s.table, s.block_size, s.token_stride},
           RowCursor{s.v + kv * s.row_bytes, s.table, s.block_size, s.token_stride}, kept);
    }
  });
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
    double scale,
    bool invariant) {                  // bf16 products over a bf16 cache, as the decode kernel's
                                       // invariant order (attention_simd.h)
  const paged::Rows kind =
      paged::check_attention_args("paged_prefill_attention", q, k_cache, v_cache, out, block_table);
  const paged::SliceView s(q, k_cache, v_cache, block_table, out, scale);
  paged::check_slice("paged_prefill_attention", q, out, block_table, s.block_size, q_start, q_len,
                     first_pos);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  TORCH_CHECK(s.head_dim == 64 || s.head_dim == 128,
              "paged_prefill_attention: head_dim 64 or 128, not ", s.head_dim);
  const bool d64 = s.head_dim == 64;
#if defined(__AVX512F__)
  for_each_tile<__m512>(s, q_start, q_len, first_pos, 16, [&](auto&&... args) {
    if (kind == paged::Rows::Int8)
      (d64 ? prefill_tile<int8_t, 4, false> : prefill_tile<int8_t, 8, false>)(args...);
    else if (kind == paged::Rows::BF16 && invariant)
      (d64 ? prefill_tile<c10::BFloat16, 4, true> : prefill_tile<c10::BFloat16, 8, true>)(args...);
    else if (kind == paged::Rows::BF16)
      (d64 ? prefill_tile<c10::BFloat16, 4, false> : prefill_tile<c10::BFloat16, 8, false>)(
          args...);
    else (d64 ? prefill_tile<float, 4, false> : prefill_tile<float, 8, false>)(args...);
  });
#else
  (void)invariant;  // the order of the AVX-512 tiles alone (attention_simd.h)
  for_each_tile<__m256>(s, q_start, q_len, first_pos, 8, [&](auto&&... args) {
    (d64 ? prefill_tile8<64> : prefill_tile8<128>)(kind, args...);
  });
#endif
#else
  TORCH_CHECK(false, "paged_prefill_attention needs AVX-512 or AVX2 (the torch backend uses SDPA)");
#endif
}

bool prefill_attention_kernel() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

