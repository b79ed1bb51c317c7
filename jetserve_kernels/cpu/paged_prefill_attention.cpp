// Prefill attention straight from the paged KV cache, for the CPU (AVX-512, or AVX2 with FMA;
// without them the torch backend runs SDPA over gathered blocks): each slice's new tokens
// against its cached context and themselves, causal, over an fp32, bf16 or int8 cache
// (jetserve_kernels/kv_int8.py).
//
// AVX2 builds run tiles of 16 rows (two vectors of 8) in the same two passes (prefill_tile16),
// over the slice's rows staged once a call as fp32 (stage_rows), without the batch-invariant
// order below.
//
// AVX-512 builds: flash-style tiles of 16 (token, query head) rows of one KV head, one row per
// vector lane, over 16 keys at a time. Scores come out transposed, one vector of the tile's rows
// per key, so the softmax's maxima and sums run across vectors; the keys and values are read once
// per tile through the block table, nothing gathered. The arithmetic keeps the batch-invariant
// order (attention_simd.h): the decode kernel asked for that order gives each token the same
// bits. Asked for that order (`invariant`, a bf16 model's prefill) over a bf16 or int8 cache,
// where the CPU has AVX512-BF16, its products are bf16 dot products: the queries and weights in
// bf16 pairs against the keys' pairs of elements and the values' pairs of positions
// (prefill_tile_pairs), over the slice's keys and values staged once a call for all its tiles
// (stage_pairs). Over an int8 cache the keys are staged as their codes, which meet each query in
// 16-bit codes in integer sums (attention_simd.h), and the values dequantized and rounded.

#include "ops.h"
#include "attention_simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// Scratch at least n long. Never shrunk: tiles alternate between short and long (see
// for_each_tile), as do slices, and a resize up zero-fills what it adds, each time.
template <typename Vector>
void grow(std::vector<Vector>& scratch, int64_t n) {
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
}

// A slice's keys and values staged once a call, as fp32, for every tile of its KV heads (the
// tiles with fp32 products): each KV head's rows contiguous, positions rounded up to a tile's
// chunk of keys with zero rows.
struct StagedRows {
  int64_t positions;  // a KV head's rows
  int64_t head_dim;
  const float* keys;    // [KV head][positions][head_dim]
  const float* values;  // the same

  const float* keys_of(int64_t kv) const { return keys + kv * positions * head_dim; }
  const float* values_of(int64_t kv) const { return values + kv * positions * head_dim; }
};

// Calls stage(kv, c0, n, keys, values) for each `chunk` positions from c0 of each KV head, over a
// slice's first num_keys positions (n of them there, the rest padding), the cursors at c0; the
// chunks in parallel.
template <typename Stage>
void for_each_chunk(const paged::SliceView& s, int64_t num_keys, int64_t chunk,
                    const Stage& stage) {
  const int64_t chunks = (num_keys + chunk - 1) / chunk;
  at::parallel_for(0, s.num_kv_heads * chunks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / chunks, c0 = task % chunks * chunk;
      paged::RowCursor k{s.k + kv * s.row_bytes, s.table, s.block_size, s.token_stride,
                         c0 / s.block_size, c0 % s.block_size};
      paged::RowCursor v{s.v + kv * s.row_bytes, s.table, s.block_size, s.token_stride,
                         c0 / s.block_size, c0 % s.block_size};
      stage(kv, c0, static_cast<int>(std::min(chunk, num_keys - c0)), k, v);
    }
  });
}

}  // namespace

#if defined(__AVX512F__)
namespace {

using namespace paged;

// A slice's fp32, bf16 or int8 rows staged once a call as fp32 for every tile of its KV heads:
// each KV head's keys and values contiguous, widened as the tiles widened them (load_row), zero
// rows past the last position, up to a multiple of 16. Each tile had copied (and widened) every
// row it read, and a 2,048-token slice has 384 tiles a KV head.
template <typename T, int DV>
StagedRows stage_rows(const SliceView& s, int64_t num_keys, std::vector<__m512>& scratch) {
  constexpr int D = 16 * DV;
  const int64_t positions = (num_keys + 15) / 16 * 16;
  grow(scratch, 2 * s.num_kv_heads * positions * D / 16);
  float* keys = reinterpret_cast<float*>(scratch.data());
  float* values = keys + s.num_kv_heads * positions * D;
  for_each_chunk(s, num_keys, 16,
                 [&](int64_t kv, int64_t c0, int n, RowCursor& k, RowCursor& v) {
    for (int64_t j = 0; j < 16; ++j) {
      float* kd = keys + (kv * positions + c0 + j) * D;
      float* vd = values + (kv * positions + c0 + j) * D;
      __m512 kr[DV], vr[DV];
      if (j < n) {
        load_row<T, DV>(k.next(), kr);
        load_row<T, DV>(v.next(), vr);
      } else {
        for (int d = 0; d < DV; ++d) kr[d] = vr[d] = _mm512_setzero_ps();
      }
      for (int d = 0; d < DV; ++d) {
        _mm512_store_ps(kd + 16 * d, kr[d]);
        _mm512_store_ps(vd + 16 * d, vr[d]);
      }
    }
  });
  return {positions, D, keys, values};
}

// A tile's rows: [r0, r0 + 16) of a slice's (token, head) rows, r = token * group + head, of one
// KV head, one a lane (spare lanes repeat the last row). q points at the slice's first token and
// the KV head's first query head.
template <int DV>
struct TileRows {
  static constexpr int D = 16 * DV;
  int live;          // the rows there
  __m512 qt[D];      // the scaled queries, transposed: qt[d] holds element d of every row
  __m512 pos;        // each lane's position
  int64_t all_see;   // the keys every lane sees: [0, all_see]
  int64_t num_keys;  // the keys some lane sees: [0, num_keys)

  TileRows(const float* q, int64_t q_stride, int64_t r0, int64_t num_rows, int64_t group,
           int64_t first_pos, float scale)
      : live(static_cast<int>(std::min<int64_t>(16, num_rows - r0))),
        all_see(first_pos + r0 / group),
        num_keys(first_pos + (r0 + live - 1) / group + 1) {
    __m512 rows[16][DV];
    alignas(64) float lane_pos[16];
    for (int lane = 0; lane < 16; ++lane) {
      const int64_t r = r0 + std::min(lane, live - 1);
      scaled_query<DV>(q + (r / group) * q_stride + (r % group) * D, scale,
                       reinterpret_cast<float*>(rows[lane]));
      lane_pos[lane] = static_cast<float>(first_pos + r / group);
    }
    for (int b = 0; b < DV; ++b) transpose16(&rows[0][b], DV, qt + 16 * b);
    pos = _mm512_load_ps(lane_pos);
  }

  // Which lanes see key c0 + j of a chunk of n keys from c0 (all of them, far enough back).
  __mmask16 seen(int64_t c0, int n, int j) const {
    if (j >= n) return 0;
    if (c0 + j <= all_see) return 0xFFFF;
    return _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(c0 + j)), pos, _CMP_LE_OQ);
  }

  // Each lane's total from its 16 partials (part[j]: the lane's sum over keys j, j + 16, ...),
  // then its outputs, ot[d] (element d of every lane's value sums) over that total, into out.
  void write(const __m512 part[16], const __m512 ot[D], float* out, int64_t out_stride,
             int64_t r0, int64_t group) const {
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
};

// Rows [r0, r0 + 16) of a slice's (token, head) rows, r = token * group + head, for one KV head,
// over keys [0, last row's position], staged (stage_rows). q and out point at the slice's first
// token and the KV head's first query head. Two passes rather than an online softmax (which
// would rescale the sums as the maximum grows, in an order no decode keeps): first every key's
// scores, kept in `kept`, with each lane's maximum; then the exponentials in their place and
// the lanes' 16 partial totals; then the value sums 16 elements at a time, in registers, each a
// chain over the positions in order (a lane skipping the keys it does not see). (With bf16
// products: prefill_tile_pairs below.)
template <int DV>
void prefill_tile(const float* q, int64_t q_stride, float* out, int64_t out_stride, int64_t r0,
                  int64_t num_rows, int64_t group, int64_t first_pos, float scale,
                  const float* keys, const float* values, std::vector<__m512>& kept) {
  constexpr int D = 16 * DV;
  const TileRows<DV> tile(q, q_stride, r0, num_rows, group, first_pos, scale);
  const __m512* qt = tile.qt;
  const int64_t all_see = tile.all_see, num_keys = tile.num_keys;
  auto seen = [&](int64_t c0, int n, int j) { return tile.seen(c0, n, j); };
  grow(kept, (num_keys + 15) / 16 * 16);

  // Scores, and each lane's largest.
  __m512 peak = _mm512_set1_ps(-INFINITY);
  for (int64_t c0 = 0; c0 < num_keys; c0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, num_keys - c0));
    const float* k = keys + c0 * D;
    __m512 sc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) sc[j] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 qd = qt[d];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) sc[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(k[j * D + d]), sc[j]);
    }
    for (int j = 0; j < n; ++j) {
      kept[c0 + j] = sc[j];
      peak = _mm512_mask_max_ps(peak, seen(c0, n, j), peak, sc[j]);
    }
  }

  // The exponentials in place of the scores, and their partial totals.
  __m512 part[16];
  for (int j = 0; j < 16; ++j) part[j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < num_keys; c0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, num_keys - c0));
    // Every lane sees every key (all chunks but the last few of a tile): unmasked, the same
    // sums as the masked loop below with all lanes set.
    if (n == 16 && c0 + 15 <= all_see) {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(kept[c0 + j], peak));
        // A masked add, as the decode's partials take (a plain vector add is open to
        // -ffast-math's reassociation, were this loop ever unrolled over positions).
        part[j] = _mm512_mask_add_ps(part[j], 0xFFFF, part[j], e);
        kept[c0 + j] = e;
      }
      continue;
    }
    for (int j = 0; j < n; ++j) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(kept[c0 + j], peak));
      part[j] = _mm512_mask_add_ps(part[j], seen(c0, n, j), part[j], e);
      kept[c0 + j] = e;
    }
  }

  // The value sums, 16 elements at a time: keys every lane sees, then the last few, which some
  // lanes skip (a masked multiply-add leaves their sums as they were).
  const int64_t full = std::min(num_keys, all_see + 1);
  __mmask16 tail[16];  // the tile spans at most 16 tokens: at most 15 keys after all_see
  for (int64_t c = full; c < num_keys; ++c) tail[c - full] = seen(c, 1, 0);
  __m512 ot[D];
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m512 o[16];
#pragma GCC unroll 16
    for (int dd = 0; dd < 16; ++dd) o[dd] = _mm512_setzero_ps();
    const float* v = values + d0;
    for (int64_t c = 0; c < full; ++c, v += D) {
      const __m512 w = kept[c];
#pragma GCC unroll 16
      for (int dd = 0; dd < 16; ++dd) o[dd] = _mm512_fmadd_ps(w, _mm512_set1_ps(v[dd]), o[dd]);
    }
    for (int64_t c = full; c < num_keys; ++c, v += D) {
      const __m512 w = kept[c];
      const __mmask16 m = tail[c - full];
#pragma GCC unroll 16
      for (int dd = 0; dd < 16; ++dd)
        o[dd] = _mm512_mask3_fmadd_ps(w, _mm512_set1_ps(v[dd]), o[dd], m);
    }
#pragma GCC unroll 16
    for (int dd = 0; dd < 16; ++dd) ot[d0 + dd] = o[dd];
  }

  tile.write(part, ot, out, out_stride, r0, group);
}


#if defined(PAGED_BF16_PRODUCTS)
// A bf16 or int8 cache's rows of one slice for bf16 products, staged once a call for every tile
// of its KV heads (a bf16 model's prefill, `invariant`): each KV head's keys contiguous, a bf16
// row's pairs of elements as they are or an int8 row's codes as 16-bit pairs (key_codes), its
// groups' scales and offsets in fp32 in an array after the values; and its values in bf16 pairs
// of positions, values[m][d] = (v[2m][d], v[2m + 1][d]) (an int8 row dequantized and rounded as
// the decode kernel rounds it, attention_simd.h); zeros past the last position, up to a multiple
// of 16. A tile then reads them straight through: before, each tile copied and interleaved every
// row it read, and a 2,048-token slice has 384 tiles a KV head.
struct StagedPairs {
  int64_t positions;  // a KV head's rows: the slice's last position + 1, rounded up to 16
  int64_t head_dim;
  const uint16_t* keys;    // [KV head][positions][head_dim]
  const uint32_t* values;  // [KV head][positions / 2][head_dim]
  const float* params;     // int8: [KV head][positions][head_dim / 32][scale, offset]

  const uint16_t* keys_of(int64_t kv) const { return keys + kv * positions * head_dim; }
  const uint32_t* values_of(int64_t kv) const { return values + kv * positions / 2 * head_dim; }
  const float* params_of(int64_t kv) const {
    return params ? params + kv * positions * head_dim / 16 : nullptr;
  }
};

template <typename T, int DV>
StagedPairs stage_pairs(const SliceView& s, int64_t num_keys, std::vector<__m512i>& scratch) {
  constexpr int D = 16 * DV;
  constexpr bool kCodes = std::is_same_v<T, int8_t>;
  // A row of zeros, bf16 or int8 (codes, scales and offsets all 0: 18 * DV bytes of these).
  alignas(64) static const uint16_t zeros[D] = {};
  const int64_t positions = (num_keys + 15) / 16 * 16;
  // 2 bytes a key element and 2 a value's, and an int8 key's 8 bytes of parameters a group.
  grow(scratch, s.num_kv_heads * positions * (D * 4 + (kCodes ? D / 4 : 0)) / 64);
  uint16_t* keys = reinterpret_cast<uint16_t*>(scratch.data());
  uint32_t* values = reinterpret_cast<uint32_t*>(keys + s.num_kv_heads * positions * D);
  float* params = kCodes ? reinterpret_cast<float*>(values + s.num_kv_heads * positions / 2 * D)
                         : nullptr;
  for_each_chunk(s, num_keys, 16,
                 [&](int64_t kv, int64_t c0, int n, RowCursor& k, RowCursor& v) {
    uint16_t* kd = keys + (kv * positions + c0) * D;
    for (int j = 0; j < 16; ++j) {
      const char* row = j < n ? k.next() : reinterpret_cast<const char*>(zeros);
      if constexpr (kCodes)
        key_codes<DV>(row, kd + j * D, params + (kv * positions + c0 + j) * D / 16);
      else
        key_pairs<DV>(row, kd + j * D);
    }
    uint32_t* vd = values + (kv * positions + c0) / 2 * D;
    for (int m = 0; m < 8; ++m) {
      const char* a = 2 * m < n ? v.next() : reinterpret_cast<const char*>(zeros);
      const char* b = 2 * m + 1 < n ? v.next() : reinterpret_cast<const char*>(zeros);
      __m512i pairs[DV];
      value_pairs<T, DV>(a, b, pairs);
      for (int d = 0; d < DV; ++d) _mm512_store_si512(vd + m * D + 16 * d, pairs[d]);
    }
  });
  return {positions, D, keys, values, params};
}

// prefill_tile's rows in the batch-invariant order with bf16 products (attention_simd.h), over
// staged keys and values (stage_pairs): the same chains as the decode kernel's. Scores as
// prefill_tile makes them (over an int8 cache, `params` given: each lane's query in 16-bit codes
// against the keys' codes, one integer sum a group); then every weight, rounded and paired by
// position, into `kept` after the scores; then the values' sums 16 elements at a time, each a
// chain over every pair of positions in registers, reading each pair of value rows as it is,
// with no copy.
template <int DV>
void prefill_tile_pairs(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                        int64_t r0, int64_t num_rows, int64_t group, int64_t first_pos,
                        float scale, const uint16_t* keys, const float* params,
                        const uint32_t* values, std::vector<__m512>& kept) {
  constexpr int D = 16 * DV;
  const TileRows<DV> tile(q, q_stride, r0, num_rows, group, first_pos, scale);
  const __m512* qt = tile.qt;
  const int64_t all_see = tile.all_see, num_keys = tile.num_keys;
  auto seen = [&](int64_t c0, int n, int j) { return tile.seen(c0, n, j); };
  const int64_t padded = (num_keys + 15) / 16 * 16;
  grow(kept, padded + padded / 2);  // the scores, then the weights' pairs
  __m512* scores = kept.data();
  __m512i* weights = reinterpret_cast<__m512i*>(kept.data() + padded);

  // Scores: the scaled queries as bf16 pairs of elements against each key's pairs, or (int8)
  // as 16-bit codes (each lane's row coded as the decode kernel codes it, then transposed).
  constexpr int G = DV / 2;
  __m512i qp[D / 2];
  __m512 query_sums[G], unit;
  if (params) {
    alignas(64) uint32_t pairs[16][D / 2];
    alignas(64) float sums[G][16], units[16];
    for (int lane = 0; lane < 16; ++lane) {
      const int64_t r = r0 + std::min(lane, tile.live - 1);
      alignas(64) float row[D];
      scaled_query<DV>(q + (r / group) * q_stride + (r % group) * D, scale, row);
      float lane_sums[G];
      units[lane] = query_codes<DV>(row, pairs[lane], lane_sums);
      for (int g = 0; g < G; ++g) sums[g][lane] = lane_sums[g];
    }
    for (int b = 0; b < G; ++b)
      transpose16(reinterpret_cast<const __m512*>(&pairs[0][16 * b]), D / 32,
                  reinterpret_cast<__m512*>(qp + 16 * b));
    for (int g = 0; g < G; ++g) query_sums[g] = _mm512_load_ps(sums[g]);
    unit = _mm512_load_ps(units);
  } else {
    for (int i = 0; i < D / 2; ++i) qp[i] = bf16_pairs(qt[2 * i], qt[2 * i + 1]);
  }
  __m512 peak = _mm512_set1_ps(-INFINITY);
  for (int64_t c0 = 0; c0 < num_keys; c0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, num_keys - c0));
    const uint32_t* k = reinterpret_cast<const uint32_t*>(keys + c0 * D);
    __m512 sc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) sc[j] = _mm512_setzero_ps();
    if (params) {
      // Each key's chain over the groups kept in its place in `scores` (padded to 16 keys)
      // between groups, not in registers: the 16 integer sums alone then fill them, as the bf16
      // products' 16 sums do (with the chains too the loop spilled and copied them: 9 % slower).
      const float* kp = params + c0 * 2 * G;  // key j's group g: kp[2 (G j + g)], + 1
      __m512* chain = scores + c0;
      for (int g = 0; g < G; ++g) {
        __m512i sums[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) sums[j] = _mm512_setzero_si512();
        for (int i = 16 * g; i < 16 * g + 16; ++i) {
          const __m512i qi = qp[i];
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j)
            sums[j] = dot_codes(sums[j], qi, _mm512_set1_epi32(static_cast<int>(k[j * D / 2 + i])));
        }
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
          chain[j] = add_group(g == 0 ? _mm512_setzero_ps() : chain[j], sums[j],
                               _mm512_set1_ps(kp[2 * (G * j + g)]), query_sums[g],
                               _mm512_set1_ps(kp[2 * (G * j + g) + 1]));
      }
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) sc[j] = _mm512_mul_ps(chain[j], unit);
    } else {
      for (int i = 0; i < D / 2; ++i) {
        const __m512i qi = qp[i];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
          sc[j] = dot_pairs(sc[j], qi, _mm512_set1_epi32(static_cast<int>(k[j * D / 2 + i])));
      }
    }
    for (int j = 0; j < n; ++j) {
      scores[c0 + j] = sc[j];
      peak = _mm512_mask_max_ps(peak, seen(c0, n, j), peak, sc[j]);
    }
  }

  // Weights rounded to bf16, zero where a lane does not see the key, and the partial totals.
  __m512 part[16];
  for (int j = 0; j < 16; ++j) part[j] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < num_keys; c0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, num_keys - c0));
    __m512 e[16];
    if (n == 16 && c0 + 15 <= all_see) {  // every lane sees every key: no masks
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        e[j] = bf16_rounded(exp_nonpositive(_mm512_sub_ps(scores[c0 + j], peak)));
        part[j] = _mm512_mask_add_ps(part[j], 0xFFFF, part[j], e[j]);
      }
    } else {
      for (int j = 0; j < 16; ++j) {
        const __mmask16 sees = seen(c0, n, j);
        e[j] = bf16_rounded(_mm512_maskz_mov_ps(
            sees, exp_nonpositive(_mm512_sub_ps(j < n ? scores[c0 + j] : peak, peak))));
        part[j] = _mm512_mask_add_ps(part[j], sees, part[j], e[j]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < 8; ++m) weights[c0 / 2 + m] = bf16_pairs(e[2 * m], e[2 * m + 1]);
  }

  // The value sums, 16 elements at a time: one chain a lane and element over the pairs of
  // positions in order.
  const int64_t num_pairs = (num_keys + 1) / 2;
  __m512 ot[D];
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m512 o[16];
#pragma GCC unroll 16
    for (int dd = 0; dd < 16; ++dd) o[dd] = _mm512_setzero_ps();
    const uint32_t* v = values + d0;
    for (int64_t m = 0; m < num_pairs; ++m, v += D) {
      const __m512i w = weights[m];
#pragma GCC unroll 16
      for (int dd = 0; dd < 16; ++dd)
        o[dd] = dot_pairs(o[dd], w, _mm512_set1_epi32(static_cast<int>(v[dd])));
    }
#pragma GCC unroll 16
    for (int dd = 0; dd < 16; ++dd) ot[d0 + dd] = o[dd];
  }

  tile.write(part, ot, out, out_stride, r0, group);
}
#endif

}  // namespace
#elif defined(__AVX2__) && defined(__FMA__)
namespace {

using namespace paged;

// One cache row as fp32 into dst: an fp32 row copied, a bf16 or int8 row widened.
inline void stage_row(Rows kind, const char* row, int64_t head_dim, float* dst) {
  if (kind == Rows::F32) {
    std::memcpy(dst, row, head_dim * sizeof(float));
  } else {
    widen_row8(kind, row, head_dim, dst);
  }
}

// AVX2: a slice's rows as fp32 (StagedRows), bf16 and int8 rows widened once, zero rows past
// the last position up to a multiple of 8.
StagedRows stage_rows(const SliceView& s, Rows kind, int64_t num_keys,
                      std::vector<__m256>& scratch) {
  const int64_t D = s.head_dim, positions = (num_keys + 7) / 8 * 8;
  grow(scratch, 2 * s.num_kv_heads * positions * D / 8);
  float* keys = reinterpret_cast<float*>(scratch.data());
  float* values = keys + s.num_kv_heads * positions * D;
  for_each_chunk(s, num_keys, 8,
                 [&](int64_t kv, int64_t c0, int n, RowCursor& k, RowCursor& v) {
    for (int64_t j = 0; j < 8; ++j) {
      float* kd = keys + (kv * positions + c0 + j) * D;
      float* vd = values + (kv * positions + c0 + j) * D;
      if (j < n) {
        stage_row(kind, k.next(), D, kd);
        stage_row(kind, v.next(), D, vd);
      } else {
        std::memset(kd, 0, D * sizeof(float));
        std::memset(vd, 0, D * sizeof(float));
      }
    }
  });
  return {positions, D, keys, values};
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

// AVX2 (8 lanes, 16 registers): rows [r0, r0 + 16) of a slice's (token, head) rows of one KV
// head, two vectors of 8, over staged keys and values (stage_rows), in the AVX-512 tile's two
// passes. Scores: the scaled queries kept transposed (qt[d]: element d of the 16 rows), 4 keys
// at a time, each key's element d broadcast against both vectors (8 multiply-adds to 6 loads);
// a score is a chain of FMAs in one lane, no horizontal sum; each lane's maximum. Then the
// weights (0 for a key a lane does not see) in place of the scores, and their totals. Then the
// value sums, also rows in lanes: 4 elements at a time for 64 keys at a time, each key's 4
// values broadcast against the rows' weights, the sums in registers. No batch-invariant order
// here: an AVX2 build has no bf16 products, and the engine asks for that order only with them.
template <int D>
void prefill_tile16(const float* q, int64_t q_stride, float* out, int64_t out_stride,
                    int64_t r0, int64_t num_rows, int64_t group, int64_t first_pos, float scale,
                    const float* keys, const float* values, std::vector<__m256>& kept) {
  const int live = static_cast<int>(std::min<int64_t>(16, num_rows - r0));
  alignas(32) float qt[D][16];
  alignas(32) float lane_pos[16];
  const float* src[16];
  for (int lane = 0; lane < 16; ++lane) {
    const int64_t r = r0 + std::min(lane, live - 1);  // spare lanes repeat the last row
    src[lane] = q + (r / group) * q_stride + (r % group) * D;
    lane_pos[lane] = static_cast<float>(first_pos + r / group);
  }
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int h = 0; h < 2; ++h)
    for (int d = 0; d < D; d += 8) {
      __m256 block[8];
#pragma GCC unroll 8
      for (int lane = 0; lane < 8; ++lane)
        block[lane] = _mm256_mul_ps(_mm256_loadu_ps(src[8 * h + lane] + d), scale8);
      transpose8(block);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) _mm256_store_ps(qt[d + i] + 8 * h, block[i]);
    }
  const __m256 pos[2] = {_mm256_load_ps(lane_pos), _mm256_load_ps(lane_pos + 8)};
  const int64_t all_see = first_pos + r0 / group;  // the keys every lane sees: [0, all_see]
  const int64_t num_keys = first_pos + (r0 + live - 1) / group + 1;
  grow(kept, 2 * ((num_keys + 7) / 8 * 8));  // two vectors a key: scores, then weights
  __m256* w = kept.data();
  // All ones in the lanes of half h that see key c.
  auto seen = [&](int64_t c, int h) -> __m256 {
    if (c <= all_see) return _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    return _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(c)), pos[h], _CMP_LE_OQ);
  };

  // Scores, and each lane's largest.
  const __m256 lowest = _mm256_set1_ps(-INFINITY);
  __m256 peak[2] = {lowest, lowest};
  for (int64_t c0 = 0; c0 < num_keys; c0 += 4) {
    const float* k = keys + c0 * D;
    __m256 sc[4][2];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) sc[j][0] = sc[j][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m256 q0 = _mm256_load_ps(qt[d]), q1 = _mm256_load_ps(qt[d] + 8);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 b = _mm256_broadcast_ss(k + j * D + d);
        sc[j][0] = _mm256_fmadd_ps(q0, b, sc[j][0]);
        sc[j][1] = _mm256_fmadd_ps(q1, b, sc[j][1]);
      }
    }
    const int n = static_cast<int>(std::min<int64_t>(4, num_keys - c0));
    for (int j = 0; j < n; ++j)
      for (int h = 0; h < 2; ++h) {
        w[2 * (c0 + j) + h] = sc[j][h];
        peak[h] = _mm256_max_ps(peak[h], _mm256_blendv_ps(lowest, sc[j][h], seen(c0 + j, h)));
      }
  }

  // The weights, in place of the scores, and their totals.
  __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < num_keys; ++c)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 e = _mm256_and_ps(seen(c, h),
                                     exp_nonpositive8(_mm256_sub_ps(w[2 * c + h], peak[h])));
      w[2 * c + h] = e;
      total[h] = _mm256_add_ps(total[h], e);
    }

  // The value sums, rows in lanes: ot[d] holds element d of the 16 rows.
  alignas(32) float ot[D][16];
  constexpr int64_t kKeys = 64;  // a block of keys: its weights and value rows stay in L1
  for (int64_t c0 = 0; c0 < num_keys; c0 += kKeys) {
    const int64_t c1 = std::min(num_keys, c0 + kKeys);
    for (int d0 = 0; d0 < D; d0 += 4) {
      __m256 o[4][2];
#pragma GCC unroll 4
      for (int dd = 0; dd < 4; ++dd)
        for (int h = 0; h < 2; ++h)
          o[dd][h] = c0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(ot[d0 + dd] + 8 * h);
      const float* v = values + c0 * D + d0;
      for (int64_t c = c0; c < c1; ++c, v += D) {
        const __m256 w0 = w[2 * c], w1 = w[2 * c + 1];
#pragma GCC unroll 4
        for (int dd = 0; dd < 4; ++dd) {
          const __m256 b = _mm256_broadcast_ss(v + dd);
          o[dd][0] = _mm256_fmadd_ps(w0, b, o[dd][0]);
          o[dd][1] = _mm256_fmadd_ps(w1, b, o[dd][1]);
        }
      }
#pragma GCC unroll 4
      for (int dd = 0; dd < 4; ++dd)
        for (int h = 0; h < 2; ++h) _mm256_store_ps(ot[d0 + dd] + 8 * h, o[dd][h]);
    }
  }

  // Each row's outputs: 8 elements of 8 rows transposed at a time, over its total.
  alignas(32) float totals[16];
  _mm256_store_ps(totals, total[0]);
  _mm256_store_ps(totals + 8, total[1]);
  for (int h = 0; h < 2; ++h)
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 block[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) block[i] = _mm256_load_ps(ot[d0 + i] + 8 * h);
      transpose8(block);  // block[lane]: row 8h + lane's elements [d0, d0 + 8)
      for (int lane = 0; lane < 8 && 8 * h + lane < live; ++lane) {
        const int64_t r = r0 + 8 * h + lane;
        _mm256_storeu_ps(out + (r / group) * out_stride + (r % group) * D + d0,
                         _mm256_mul_ps(block[lane], _mm256_set1_ps(1.0f / totals[8 * h + lane])));
      }
    }
}

}  // namespace
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {

// Runs tile(KV head, q, q_stride, out, out_stride, first row, rows, group, first_pos, scale,
// kept) for every task of a slice: each tile of `rows` (token, query head) rows of each KV head. Tasks go KV head by KV head, so a thread reads one head's rows at a time; within a
// head later tiles attend to more keys, so tasks alternate between its first and last tiles and
// the contiguous ranges parallel_for hands each thread carry equal work.
template <typename Vector, typename Tile>
void for_each_tile(const paged::SliceView& s, int64_t q_start, int64_t q_len, int64_t first_pos,
                   int64_t rows, const Tile& tile) {
  const int64_t num_rows = q_len * s.group, tiles = (num_rows + rows - 1) / rows;
  at::parallel_for(0, tiles * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vector> kept;  // the scores of a tile
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / tiles, i = task % tiles;
      const int64_t t = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
      tile(kv, s.q + q_start * s.q_stride + kv * s.group * s.head_dim, s.q_stride,
           s.out + q_start * s.out_stride + kv * s.group * s.head_dim, s.out_stride, t * rows,
           num_rows, s.group, first_pos, s.scale, kept);
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
    bool invariant) {                  // the decode kernel's invariant order (attention_simd.h):
                                       // bf16 (int8 keys: integer) products over a bf16
                                       // or int8 cache
  const paged::Rows kind =
      paged::check_attention_args("paged_prefill_attention", q, k_cache, v_cache, out, block_table);
  const paged::SliceView s(q, k_cache, v_cache, block_table, out, scale);
  paged::check_slice("paged_prefill_attention", q, out, block_table, s.block_size, q_start, q_len,
                     first_pos);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  TORCH_CHECK(s.head_dim == 64 || s.head_dim == 128,
              "paged_prefill_attention: head_dim 64 or 128, not ", s.head_dim);
  const bool d64 = s.head_dim == 64;
  // A slice of one tile a KV head or less (16 (token, query head) rows: a new turn after a cached
  // prefix, a chunked prompt's short last piece) runs as rows of the decode kernel: staging its
  // whole context for one tile cost more than the tile (2 tokens after 4,096 cached, 30 layers
  // of SmolLM2 over a bf16 cache: 17.7 ms, as decode rows 7.9).
  if (q_len * s.group <= 16) {
    prefill_as_decode_rows(q, k_cache, v_cache, block_table, q_start, q_len, first_pos, out,
                           scale, invariant);
    return;
  }
#if defined(__AVX512F__)
#if defined(PAGED_BF16_PRODUCTS)
  if (kind != paged::Rows::F32 && invariant) {  // bf16 products over a bf16 or int8 cache
    static thread_local std::vector<__m512i> scratch;  // kept for the next call: no page faults
    const bool int8 = kind == paged::Rows::Int8;
    const auto staged =
        (d64 ? (int8 ? stage_pairs<int8_t, 4> : stage_pairs<c10::BFloat16, 4>)
             : (int8 ? stage_pairs<int8_t, 8> : stage_pairs<c10::BFloat16, 8>))(
            s, first_pos + q_len, scratch);
    for_each_tile<__m512>(
        s, q_start, q_len, first_pos, 16,
        [&](int64_t kv, const float* q_, int64_t q_stride, float* out_, int64_t out_stride,
            int64_t r0, int64_t num_rows, int64_t group, int64_t first, float scale_,
            std::vector<__m512>& kept) {
          (d64 ? prefill_tile_pairs<4> : prefill_tile_pairs<8>)(
              q_, q_stride, out_, out_stride, r0, num_rows, group, first, scale_,
              staged.keys_of(kv), staged.params_of(kv), staged.values_of(kv), kept);
        });
    return;
  }
#endif
  static thread_local std::vector<__m512> scratch;  // kept for the next call: no page faults
  const int64_t num_keys = first_pos + q_len;
  const StagedRows staged =
      kind == paged::Rows::Int8
          ? (d64 ? stage_rows<int8_t, 4> : stage_rows<int8_t, 8>)(s, num_keys, scratch)
      : kind == paged::Rows::BF16
          ? (d64 ? stage_rows<c10::BFloat16, 4> : stage_rows<c10::BFloat16, 8>)(s, num_keys,
                                                                               scratch)
          : (d64 ? stage_rows<float, 4> : stage_rows<float, 8>)(s, num_keys, scratch);
  for_each_tile<__m512>(
      s, q_start, q_len, first_pos, 16,
      [&](int64_t kv, const float* q_, int64_t q_stride, float* out_, int64_t out_stride,
          int64_t r0, int64_t num_rows, int64_t group, int64_t first, float scale_,
          std::vector<__m512>& kept) {
        (d64 ? prefill_tile<4> : prefill_tile<8>)(q_, q_stride, out_, out_stride, r0, num_rows,
                                                  group, first, scale_, staged.keys_of(kv),
                                                  staged.values_of(kv), kept);
      });
#else
  (void)invariant;  // the order of the AVX-512 tiles alone (attention_simd.h)
  static thread_local std::vector<__m256> scratch;  // kept for the next call: no page faults
  const auto staged = stage_rows(s, kind, first_pos + q_len, scratch);
  for_each_tile<__m256>(
      s, q_start, q_len, first_pos, 16,
      [&](int64_t kv, const float* q_, int64_t q_stride, float* out_, int64_t out_stride,
          int64_t r0, int64_t num_rows, int64_t group, int64_t first, float scale_,
          std::vector<__m256>& kept) {
        (d64 ? prefill_tile16<64> : prefill_tile16<128>)(
            q_, q_stride, out_, out_stride, r0, num_rows, group, first, scale_,
            staged.keys_of(kv), staged.values_of(kv), kept);
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

