// Decode attention straight from the paged KV cache, for the CPU: an fp32 or bf16 cache, or an
// int8 one whose every (token, KV head) row is head_dim int8 codes followed by an fp16 scale and
// offset for each 32 of them (value = scale * code + offset; jetserve_kernels/kv_int8.py).
//
// The query heads of one KV head are scored together against every cached key, then the softmax
// weights accumulate the values. With AVX-512 (head_dim 64 or 128) the exponentials are
// vectorized and the rows prefetched ahead of their use, and the scores come in one of two
// orders: 16 products summed lane by lane, then across lanes in one tree (an fp32 model's), or
// the batch-invariant order of attention_simd.h (`invariant`: a bf16 model's), for which 16 key
// rows are transposed in registers and scored as one vector per query head (over a bf16 cache,
// where the CPU has AVX512-BF16, in bf16 dot products, the values too; over an int8 cache there,
// the keys' codes against each query in 16-bit codes, in integer sums, and the values in bf16
// dot products). With AVX2 alone (head_dim a multiple of 16) 8 keys are scored at a time, and
// elsewhere plain loops run, both in one order whatever `invariant` says. Keys and values are
// read in place through the block table, once per step for all the query heads that share them:
// nothing is gathered into a contiguous copy first (but for the AVX2 path's bf16 and int8 rows,
// widened into its scratch).
//
// paged_prefill_as_decodes gives a prefill's tokens the bits the invariant kernel gives each of
// them as a decode (a batch-invariant model's prefill): the prefill kernel's tiles, which keep
// the same order, or else a row of this kernel per token.

#include "ops.h"
#include "attention_simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
namespace {

using namespace paged;

// Rows are asked for this many positions before their use (into L2: at 128 sequences of 300
// tokens that measured ~100 ms for 30 layers, against ~145 ms for 16 rows ahead into L1).
constexpr int64_t kAhead = 32;

// Prefetches the next `count` rows of a cursor, advancing it.
template <typename T, int DV>
inline void prefetch_rows(RowCursor& cursor, int64_t count) {
  for (int64_t i = 0; i < count; ++i) prefetch_row<T, DV>(cursor.next());
}

// A KV head's key rows 16 at a time, each asked for `lead` positions before it is handed out:
// kAhead before its use where each 16 are used as they come, more where a pass takes several
// chunks before it uses them.
template <typename T, int DV>
struct KeyChunks {
  RowCursor keys, ahead;  // `ahead` runs `lead` positions in front of `keys`
  int64_t len, ahead_pos;

  KeyChunks(RowCursor first, int64_t len_, int64_t lead)
      : keys(first), ahead(first), len(len_), ahead_pos(std::min<int64_t>(lead, len_)) {
    prefetch_rows<T, DV>(ahead, ahead_pos);
  }

  // The rows from position p0 (16, or fewer at the end: the last one repeats past them) into
  // rows; returns how many.
  int next(int64_t p0, const char** rows) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - p0));
    for (int i = 0; i < n; ++i) rows[i] = keys.next();
    for (int i = n; i < 16; ++i) rows[i] = rows[n - 1];
    const int64_t more = std::min<int64_t>(16, len - ahead_pos);
    prefetch_rows<T, DV>(ahead, more);
    ahead_pos += more;
    return n;
  }
};

// A block of key elements as a chunk of 16 rows gives them to the scoring chains: transposed in
// registers so that one vector holds one element (or, with bf16 products, one pair of elements)
// of the 16 rows. A block is 16 elements of an fp32 row, 32 of a bf16 row, 64 of an int8 row.
template <typename T>
constexpr int kKeyBlock = std::is_same_v<T, float> ? 16 : std::is_same_v<T, int8_t> ? 64 : 32;
template <typename T>
constexpr int kBlockVectors = bf16_products<T> ? kKeyBlock<T> / 2 : kKeyBlock<T>;

// Block b of 16 key rows into kt[kBlockVectors<T>]: kt[v] holds element kKeyBlock * b + v of
// each row (pair v of the block with bf16 products). A bf16 row is transposed as pairs of
// elements (32-bit lanes), each pair widened after (half the shuffles of widening first), or,
// with bf16 products (attention_simd.h), not widened. An int8 row as quads of codes, each code
// then sign-extended in place and dequantized with its group's scale and offset, gathered for
// the 16 rows: one transpose per 64 elements instead of one per 16. (With bf16 products an int8
// row's codes go to key_code_group instead.)
template <typename T, int DV>
inline void key_block(const char* const* rows, int b, __m512* kt) {
  static_assert(!(std::is_same_v<T, int8_t> && bf16_products<T>));
  constexpr int D = 16 * DV;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m512 raw[16], pairs[16];
    for (int i = 0; i < 16; ++i)
      raw[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(rows[i]) + 16 * b);
    if constexpr (bf16_products<T>) {
      transpose16(raw, 1, kt);
    } else {
      transpose16(raw, 1, pairs);
      const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int l = 0; l < 16; ++l) {
        const __m512i pair = _mm512_castps_si512(pairs[l]);
        kt[2 * l] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        kt[2 * l + 1] = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
      }
    }
  } else if constexpr (std::is_same_v<T, int8_t>) {
    const __m512i base = _mm512_set1_epi64(reinterpret_cast<int64_t>(rows[0]));
    const __m512i lo = _mm512_sub_epi64(_mm512_loadu_si512(rows), base);
    const __m512i hi = _mm512_sub_epi64(_mm512_loadu_si512(rows + 8), base);
    __m512 raw[16], quads[16];
    for (int i = 0; i < 16; ++i)
      raw[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(rows[i] + 64 * b));
    transpose16(raw, 1, quads);
    for (int half = 0; half < 2; ++half) {  // groups of 32: elements 64 b + 32 half ...
      const char* at = rows[0] + D + 4 * (2 * b + half);  // the group's fp16 scale, offset
      const __m512i both = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm512_i64gather_epi32(lo, at, 1)),
          _mm512_i64gather_epi32(hi, at, 1), 1);
      const __m512 scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(both));
      const __m512 offset = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16)));
      for (int l = 8 * half; l < 8 * half + 8; ++l) {
        const __m512i quad = _mm512_castps_si512(quads[l]);
        for (int k = 0; k < 4; ++k) {
          const __m512i code = _mm512_srai_epi32(_mm512_slli_epi32(quad, 24 - 8 * k), 24);
          kt[4 * l + k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), scale, offset);
        }
      }
    }
  } else {
    static_assert(std::is_same_v<T, float>);
    __m512 raw[16];
    for (int i = 0; i < 16; ++i)
      raw[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(rows[i]) + 16 * b);
    transpose16(raw, 1, kt);
  }
}

// The scores of HB query heads (scaled, qs[h * 16 * DV + d]) against C chunks of 16 key rows
// (rows[16 c + i]) into s[c * HB + h]: one chain over d per (head, row), from 0, as
// attention_simd.h's batch-invariant order has it. With bf16 products each pair of a row's
// elements meets the head's pair rounded to bf16 (qp[h * 8 * DV + i]: elements 2i, 2i + 1) in
// one dot product. The C * HB chains are independent and interleaved: a product's latency is
// several issue slots, and three heads' chains alone (SmolLM2's group) left the unit waiting on
// each result. With C = 4 and the accumulators kept in registers (the unrolled loop) a whole
// decode over a cache in L2 takes 10 ns a (key, KV head) on one Zen 4 thread, against 13 ns for
// one chunk at a time; streaming the cache from memory it is 1.01-1.04x faster.
template <typename T, int DV, int HB, int C>
inline void score_heads(const float* qs, const uint32_t* qp, const char* const* rows, __m512* s) {
  constexpr int D = 16 * DV, kVectors = kBlockVectors<T>;
  for (int i = 0; i < C * HB; ++i) s[i] = _mm512_setzero_ps();
  alignas(64) __m512 kt[C][kVectors];
  for (int b = 0; b < D / kKeyBlock<T>; ++b) {
    for (int c = 0; c < C; ++c) key_block<T, DV>(rows + 16 * c, b, kt[c]);
#pragma GCC unroll 64
    for (int v = 0; v < kVectors; ++v) {  // each block vector loaded once for the HB heads
#if defined(PAGED_BF16_PRODUCTS)
      if constexpr (bf16_products<T>) {
        __m512i q[HB];
        for (int h = 0; h < HB; ++h)
          q[h] = _mm512_set1_epi32(static_cast<int>(qp[h * D / 2 + kVectors * b + v]));
        for (int c = 0; c < C; ++c) {
          const __m512i k = _mm512_castps_si512(kt[c][v]);
          for (int h = 0; h < HB; ++h) s[c * HB + h] = dot_pairs(s[c * HB + h], q[h], k);
        }
        continue;
      }
#endif
      __m512 q[HB];
      for (int h = 0; h < HB; ++h) q[h] = _mm512_set1_ps(qs[h * D + kKeyBlock<T> * b + v]);
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < HB; ++h) s[c * HB + h] = _mm512_fmadd_ps(q[h], kt[c][v], s[c * HB + h]);
    }
  }
}

#if defined(PAGED_BF16_PRODUCTS)
// Group g (32 elements) of 16 int8 key rows for integer products (attention_simd.h): kt[v]
// holds the pair of codes v of the group of each row, as 16-bit codes (each row's 32 codes
// sign-extended in one instruction, then the pairs transposed), and scale, offset each row's
// parameters of the group, gathered.
template <int DV>
inline void key_code_group(const char* const* rows, int g, __m512i* kt, __m512& scale,
                           __m512& offset) {
  constexpr int D = 16 * DV;
  __m512 codes[16];
  for (int i = 0; i < 16; ++i)
    codes[i] = _mm512_castsi512_ps(_mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + 32 * g))));
  transpose16(codes, 1, reinterpret_cast<__m512*>(kt));
  const __m512i base = _mm512_set1_epi64(reinterpret_cast<int64_t>(rows[0]));
  const __m512i lo = _mm512_sub_epi64(_mm512_loadu_si512(rows), base);
  const __m512i hi = _mm512_sub_epi64(_mm512_loadu_si512(rows + 8), base);
  const char* at = rows[0] + D + 4 * g;  // the group's fp16 scale, offset
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm512_i64gather_epi32(lo, at, 1)),
      _mm512_i64gather_epi32(hi, at, 1), 1);
  scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(both));
  offset = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16)));
}

// score_heads over an int8 cache with bf16 products: HB query heads in 16-bit codes (pairs
// qp[h * 8 * DV + i], group sums qsums[h * DV / 2 + g], units[h]) against C chunks of 16 key
// rows, each group's integer sums then added into the chain (attention_simd.h).
template <int DV, int HB, int C>
inline void score_heads_codes(const uint32_t* qp, const float* qsums, const float* units,
                              const char* const* rows, __m512* s) {
  constexpr int D = 16 * DV, G = DV / 2;
  for (int i = 0; i < C * HB; ++i) s[i] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    alignas(64) __m512i kt[C][16];
    __m512 scale[C], offset[C];
    for (int c = 0; c < C; ++c) key_code_group<DV>(rows + 16 * c, g, kt[c], scale[c], offset[c]);
    __m512i sums[C * HB];
    for (int i = 0; i < C * HB; ++i) sums[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int v = 0; v < 16; ++v) {
      __m512i q[HB];
      for (int h = 0; h < HB; ++h)
        q[h] = _mm512_set1_epi32(static_cast<int>(qp[h * D / 2 + 16 * g + v]));
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < HB; ++h)
          sums[c * HB + h] = dot_codes(sums[c * HB + h], kt[c][v], q[h]);
    }
    for (int h = 0; h < HB; ++h) {
      const __m512 query_sums = _mm512_set1_ps(qsums[h * G + g]);
      for (int c = 0; c < C; ++c)
        s[c * HB + h] = add_group(s[c * HB + h], sums[c * HB + h], scale[c], query_sums, offset[c]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C; ++c)
      s[c * HB + h] = _mm512_mul_ps(s[c * HB + h], _mm512_set1_ps(units[h]));
}
#endif

// A thread's working space, reused by its tasks (sized by `fit`): the scores of G query heads
// at scores[h * stride + pos], their scaled queries, maxima (per lane, then each) and totals.
struct GroupScratch {
  std::vector<float> scores, qs, peak, totals;
  // With bf16 products: qs rounded to bf16 (over an int8 cache: in 16-bit codes, with their
  // group sums and units), and the weights (of positions 2i, 2i + 1 at h * stride / 2 + i), as
  // bf16 pairs.
  std::vector<uint32_t> qpairs, wpairs;
  std::vector<float> qsums, units;
  std::vector<__m512> peaks;

  void fit(int64_t group, int64_t head_dim, int64_t stride, bool pairs) {
    if (static_cast<int64_t>(scores.size()) < group * stride) scores.resize(group * stride);
    if (pairs && static_cast<int64_t>(wpairs.size()) < group * stride / 2)
      wpairs.resize(group * stride / 2);
    if (pairs) {
      qpairs.resize(group * head_dim / 2);
      qsums.resize(group * head_dim / paged::kInt8Group);
      units.resize(group);
    }
    qs.resize(group * head_dim);
    peak.resize(group);
    totals.resize(group);
    peaks.assign(group, _mm512_set1_ps(-INFINITY));
  }
};

// A query head's scores (scaled, qv[d]: its elements [16 d, 16 d + 16)) against key rows [0, n)
// of 16 as fp32: element i is row i's dot product, lane by lane products summed in d order, then
// the 16 lanes in one transposing tree; elements from n on are 0.
template <int DV>
inline __m512 score16(const __m512* qv, const __m512 (*key)[DV], int n) {
  __m512 partial[16];
  for (int i = 0; i < 16; ++i) {
    partial[i] = _mm512_setzero_ps();
    if (i < n)
      for (int d = 0; d < DV; ++d) partial[i] = _mm512_fmadd_ps(qv[d], key[i][d], partial[i]);
  }
  return sum16(partial);
}

// The scores of G query heads against positions [0, len) of their KV head, into w.scores (head
// h's at h * stride), with their maxima in w.peak. In the batch-invariant order
// (attention_simd.h): up to 64 key rows transposed and scored for up to four heads at a time
// (for G over four, again for the next four). Otherwise in score16's cheaper order: each 16 rows
// widened once, then scored against one head after another (the next head finds them in L1).
template <typename T, int DV, bool Invariant>
void score_group(const float* q, int64_t group, float scale, RowCursor keys, int64_t len,
                 int64_t stride, GroupScratch& w) {
  constexpr int D = 16 * DV, kHeads = 4;
  float* scores = w.scores.data();
  const float* qs = w.qs.data();
  for (int64_t h = 0; h < group; ++h) scaled_query<DV>(q + h * D, scale, w.qs.data() + h * D);
#if defined(PAGED_BF16_PRODUCTS)
  if constexpr (Invariant && bf16_products<T> && std::is_same_v<T, int8_t>)
    for (int64_t h = 0; h < group; ++h)
      w.units[h] = query_codes<DV>(qs + h * D, w.qpairs.data() + h * D / 2,
                                   w.qsums.data() + h * DV / 2);
  else if constexpr (Invariant && bf16_products<T>)
    for (int64_t i = 0; i < group * D; i += 16)  // 16 values: 8 pairs
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.qpairs.data() + i / 2),
                          bf16_bits(_mm512_loadu_ps(qs + i)));
#endif
  const uint32_t* qp = w.qpairs.data();
  __m512* peaks = w.peaks.data();
  // A pass of the invariant order takes four chunks before it uses the first: the last one's
  // rows are asked for 48 positions earlier to get kAhead of lead.
  KeyChunks<T, DV> chunks(keys, len, Invariant ? kAhead + 48 : kAhead);
  if constexpr (Invariant) {
    // Up to four chunks of 16 rows a pass; the last pass takes 16, 32 or 64 rows, those past
    // len repeating the last one, scored and not kept.
    for (int64_t p0 = 0; p0 < len; p0 += 64) {
      const int64_t left = len - p0;
      const int count = left > 32 ? 4 : left > 16 ? 2 : 1;
      const char* rows[64];
      __mmask16 valid[4];
      for (int c = 0; c < count; ++c) {
        int n = 0;
        if (p0 + 16 * c < len) n = chunks.next(p0 + 16 * c, rows + 16 * c);
        else std::fill(rows + 16 * c, rows + 16 * c + 16, rows[16 * c - 1]);
        valid[c] = static_cast<__mmask16>((1u << n) - 1);
      }
      for (int64_t h0 = 0; h0 < group; h0 += kHeads) {
        const float* qh = qs + h0 * D;
        const uint32_t* ph = bf16_products<T> ? qp + h0 * D / 2 : nullptr;  // sized then
        const int heads = static_cast<int>(std::min<int64_t>(kHeads, group - h0));
        auto run = [&](auto hb, auto cc) {
          constexpr int HB = decltype(hb)::value, C = decltype(cc)::value;
          __m512 s[C * HB];
#if defined(PAGED_BF16_PRODUCTS)
          if constexpr (std::is_same_v<T, int8_t> && bf16_products<T>)
            score_heads_codes<DV, HB, C>(ph, w.qsums.data() + h0 * DV / 2, w.units.data() + h0,
                                         rows, s);
          else
#endif
            score_heads<T, DV, HB, C>(qh, ph, rows, s);
          for (int c = 0; c < C; ++c)
            for (int h = 0; h < HB; ++h) {
              _mm512_mask_storeu_ps(scores + (h0 + h) * stride + p0 + 16 * c, valid[c],
                                    s[c * HB + h]);
              peaks[h0 + h] =
                  _mm512_mask_max_ps(peaks[h0 + h], valid[c], peaks[h0 + h], s[c * HB + h]);
            }
        };
        auto chunked = [&](auto hb) {
          if (count == 4) run(hb, std::integral_constant<int, 4>{});
          else if (count == 2) run(hb, std::integral_constant<int, 2>{});
          else run(hb, std::integral_constant<int, 1>{});
        };
        switch (heads) {
          case 1: chunked(std::integral_constant<int, 1>{}); break;
          case 2: chunked(std::integral_constant<int, 2>{}); break;
          case 3: chunked(std::integral_constant<int, 3>{}); break;
          default: chunked(std::integral_constant<int, kHeads>{}); break;
        }
      }
    }
  } else {
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
      const char* rows[16];
      const int n = chunks.next(p0, rows);
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
      __m512 key[16][DV];  // the 16 rows as fp32, read once for the G heads
      for (int i = 0; i < n; ++i) load_row<T, DV>(rows[i], key[i]);
      for (int64_t h = 0; h < group; ++h) {
        __m512 qh[DV];  // in registers for the 16 rows (not a memory operand of each FMA)
        for (int e = 0; e < DV; ++e) qh[e] = _mm512_loadu_ps(qs + h * D + 16 * e);
        const __m512 s = score16<DV>(qh, key, n);
        _mm512_mask_storeu_ps(scores + h * stride + p0, valid, s);
        peaks[h] = _mm512_mask_max_ps(peaks[h], valid, peaks[h], s);
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) w.peak[h] = _mm512_reduce_max_ps(peaks[h]);
}

// e^(score - peak) in place; returns the sum. Pairs (bf16 products): each rounded to bf16 (the
// sum of the rounded ones) and written as bf16 pairs of positions into pairs instead, zeros
// after the last.
template <bool Pairs>
float exponentiate(float* scores, int64_t len, float peak, uint32_t* pairs) {
  static_assert(!Pairs || kBf16Products);
  const __m512 top = _mm512_set1_ps(peak);
  __m512 total = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - p0));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + p0), top));
#if defined(PAGED_BF16_PRODUCTS)
    if constexpr (Pairs) {
      e = bf16_rounded(_mm512_maskz_mov_ps(valid, e));  // zeros past the last
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + p0 / 2), bf16_bits(e));
    }
#endif
    if constexpr (!Pairs) _mm512_mask_storeu_ps(scores + p0, valid, e);
    total = _mm512_mask_add_ps(total, valid, total, e);
  }
  return lane_sum(total);
}

// out[h] = sum over positions of weights[h][pos] * value[pos] / totals[h], for HB heads: each
// value row is loaded once into registers for all of them.
// With bf16 products (Pairs) the positions go in pairs (p, p + 1), their weights' pairs from
// pairs[h * stride / 2 + p / 2], a row of zeros after the last position.
template <typename T, int DV, int HB, bool Pairs>
void accumulate_values(const float* weights, const uint32_t* pairs, int64_t stride,
                       const float* totals, RowCursor values, int64_t len, float* out) {
  __m512 acc[HB][DV];
  for (int h = 0; h < HB; ++h)
    for (int d = 0; d < DV; ++d) acc[h][d] = _mm512_setzero_ps();
  RowCursor ahead = values;  // its first kAhead rows were prefetched with the scores
  for (int64_t i = 0; i < std::min<int64_t>(kAhead, len); ++i) ahead.next();
#if defined(PAGED_BF16_PRODUCTS)
  if constexpr (Pairs) {
    // A row of zeros, bf16 or int8 (codes, scales and offsets all 0: 18 * DV bytes of these).
    alignas(64) static const uint16_t zeros[16 * DV] = {};
    auto step = [&](int64_t pos, const char* a, const char* b) {
      __m512i v[DV];
      value_pairs<T, DV>(a, b, v);
      for (int h = 0; h < HB; ++h) {
        const __m512i w = _mm512_set1_epi32(static_cast<int>(pairs[h * stride / 2 + pos / 2]));
        for (int d = 0; d < DV; ++d) acc[h][d] = dot_pairs(acc[h][d], w, v[d]);
      }
    };
    int64_t pos = 0;  // whole pairs, then an odd last row with zeros (a second row read only
                      // when there is one, in the loop, measured 5-8% slower at 128 x 1000)
    for (; pos + 1 < len; pos += 2) {
      if (pos + kAhead < len) prefetch_row<T, DV>(ahead.next());
      if (pos + 1 + kAhead < len) prefetch_row<T, DV>(ahead.next());
      const char* a = values.next();
      const char* b = values.next();
      step(pos, a, b);
    }
    if (pos < len) step(pos, values.next(), reinterpret_cast<const char*>(zeros));
  } else
#endif
  for (int64_t pos = 0; pos < len; ++pos) {
    const char* row = values.next();
    if (pos + kAhead < len) prefetch_row<T, DV>(ahead.next());
    __m512 v[DV];
    load_row<T, DV>(row, v);
    for (int h = 0; h < HB; ++h) {
      const __m512 w = _mm512_set1_ps(weights[h * stride + pos]);
      for (int d = 0; d < DV; ++d) acc[h][d] = _mm512_fmadd_ps(w, v[d], acc[h][d]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    const __m512 inv = _mm512_set1_ps(reciprocal(totals[h]));
    for (int d = 0; d < DV; ++d)
      _mm512_storeu_ps(out + h * 16 * DV + 16 * d, _mm512_mul_ps(acc[h][d], inv));
  }
}

// The query heads [0, group) that share one KV head, for one sequence, in the batch-invariant
// order or score16's.
template <typename T, int DV, bool Invariant>
void decode_group(const float* q, int64_t group, float scale, RowCursor keys, RowCursor values,
                  int64_t len, GroupScratch& w, float* out) {
  constexpr bool kPairs = Invariant && bf16_products<T>;
  const int64_t stride = (len + 17) & ~int64_t{1};  // even: whole pairs of positions
  w.fit(group, 16 * DV, stride, kPairs);
  score_group<T, DV, Invariant>(q, group, scale, keys, len, stride, w);
  float* scores = w.scores.data();
  float* totals = w.totals.data();
  RowCursor first_values = values;
  prefetch_rows<T, DV>(first_values, std::min<int64_t>(kAhead, len));
  for (int64_t h = 0; h < group; ++h)
    totals[h] = exponentiate<kPairs>(scores + h * stride, len, w.peak[h],
                                     w.wpairs.data() + h * stride / 2);
  // Up to 16 accumulators (HB * DV) stay in registers beside the value row.
  constexpr int kMaxHeads = 16 / DV;
  for (int64_t h0 = 0; h0 < group; h0 += kMaxHeads) {
    auto heads = [&](auto hb) {
      accumulate_values<T, DV, decltype(hb)::value, kPairs>(
          scores + h0 * stride, w.wpairs.data() + h0 * stride / 2, stride, totals + h0, values,
          len, out + h0 * 16 * DV);
    };
    switch (std::min<int64_t>(kMaxHeads, group - h0)) {
      case 1: heads(std::integral_constant<int, 1>{}); break;
      case 2: heads(std::integral_constant<int, 2>{}); break;
      case 3: heads(std::integral_constant<int, 3>{}); break;
      default: heads(std::integral_constant<int, kMaxHeads>{}); break;
    }
  }
}


}  // namespace
#endif

namespace {

// A row's values as fp32 into dst, for the portable path.
struct RowReader {
  paged::Rows kind;
  int64_t head_dim;
  void load(const char* row, float* dst) const {
    if (kind == paged::Rows::F32) {
      std::memcpy(dst, row, head_dim * sizeof(float));
      return;
    }
    if (kind == paged::Rows::BF16) {
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = paged::bf16_at(row + 2 * d);
      return;
    }
    const int8_t* codes = reinterpret_cast<const int8_t*>(row);
    const int64_t size = paged::int8_group(head_dim);
    for (int64_t g = 0; g < head_dim / size; ++g) {
      const float scale = paged::group_scale(row, head_dim, g);
      const float offset = paged::group_offset(row, head_dim, g);
      for (int64_t d = g * size; d < (g + 1) * size; ++d)
        dst[d] = scale * codes[d] + offset;
    }
  }
};

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 without AVX-512 (8 lanes, 16 registers): a task per (sequence, KV head), as on AVX-512.
// Its keys and values are read as fp32 rows in place, or (bf16, int8) widened into the task's
// scratch first, once. Scores take 8 keys at a time, a chain of FMAs per key over the head's
// elements and one horizontal sum for all 8; the exponentials 8 at a time; the values' sums a
// query head at a time over whole rows. Rows are asked for ahead of their first use.

// Rows are asked for this many positions before their use, into L2, as on AVX-512 (at 256
// sequences of 300 tokens, 30 layers: 167 ms, against 213-224 for 16 keys and 8 values ahead
// into L1, the first rows not asked for ahead).
constexpr int64_t kAvx2Ahead = 32;

// Lane j: the sum of v[j]'s lanes.
inline __m256 sums_of_8(const __m256 v[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

struct Avx2Scratch {
  std::vector<const float*> keys, values;  // a row per position, as fp32
  std::vector<float> widened;              // bf16 and int8 rows as fp32: keys, then values
  std::vector<float> q, scores, totals;
};

// out[d0 .. d0 + 8 NV) = inv_total * sum over positions p of e[p] * v[p][d0 ..], for one head:
// whole rows (up to 64 elements) a step, the rows kAvx2Ahead positions ahead asked for.
template <int NV>
void value_sums(const float* const* values, const float* e, int64_t len, int64_t d0,
                float inv_total, float* out) {
  __m256 acc[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < len; ++p) {
    if (p + kAvx2Ahead < len)
#pragma GCC unroll 8
      for (int v = 0; v < NV; v += 2)
        _mm_prefetch(reinterpret_cast<const char*>(values[p + kAvx2Ahead] + d0 + 8 * v),
                     _MM_HINT_T1);
    const __m256 w = _mm256_broadcast_ss(e + p);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values[p] + d0 + 8 * v), acc[v]);
  }
  const __m256 inv = _mm256_set1_ps(inv_total);
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + d0 + 8 * v, _mm256_mul_ps(acc[v], inv));
}

// One (sequence, KV head): its group of query heads from qh (unscaled) into o. head_dim a
// multiple of 16.
void decode_group_avx2(const float* qh, int64_t group, int64_t head_dim, float scale,
                       const char* k_base, const char* v_base, const int32_t* table,
                       int64_t block_size, int64_t token_stride, int64_t len,
                       const RowReader& cache, Avx2Scratch& s, float* o) {
  const int64_t padded = (len + 7) / 8 * 8;
  s.keys.resize(padded);
  s.values.resize(len);
  if (cache.kind != paged::Rows::F32) s.widened.resize(2 * len * head_dim);
  for (int64_t p = 0; p < len; ++p) {
    const int64_t at = (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) *
                       token_stride;
    if (cache.kind == paged::Rows::F32) {
      s.keys[p] = reinterpret_cast<const float*>(k_base + at);
      s.values[p] = reinterpret_cast<const float*>(v_base + at);
      if (p < kAvx2Ahead)  // the first rows the passes below read, asked for now
        for (int64_t d = 0; d < head_dim; d += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(s.keys[p] + d), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(s.values[p] + d), _MM_HINT_T1);
        }
    } else {
      float* k = s.widened.data() + p * head_dim;
      float* v = s.widened.data() + (len + p) * head_dim;
      paged::widen_row8(cache.kind, k_base + at, head_dim, k);
      paged::widen_row8(cache.kind, v_base + at, head_dim, v);
      s.keys[p] = k;
      s.values[p] = v;
    }
  }
  for (int64_t p = len; p < padded; ++p) s.keys[p] = s.keys[len - 1];  // scored, then dropped
  s.q.resize(group * head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) s.q[i] = qh[i] * scale;
  s.scores.resize(group * padded);
  s.totals.resize(group);
  for (int64_t h = 0; h < group; ++h) {
    const float* q = s.q.data() + h * head_dim;
    float* scores = s.scores.data() + h * padded;
    for (int64_t p0 = 0; p0 < padded; p0 += 8) {
      if (h == 0 && p0 + kAvx2Ahead < padded)  // the first head's pass reads them from memory
        for (int j = 0; j < 8; ++j)
          for (int64_t d = 0; d < head_dim; d += 16)
            _mm_prefetch(reinterpret_cast<const char*>(s.keys[p0 + kAvx2Ahead + j] + d),
                         _MM_HINT_T1);
      __m256 acc[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(s.keys[p0 + j] + d), acc[j]);
      }
      _mm256_storeu_ps(scores + p0, sums_of_8(acc));
    }
    __m256 peak = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t p = 0;
    for (; p + 8 <= len; p += 8) peak = _mm256_max_ps(peak, _mm256_loadu_ps(scores + p));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, peak);
    float top = *std::max_element(lanes, lanes + 8);
    for (; p < len; ++p) top = std::max(top, scores[p]);
    const __m256 top8 = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    for (p = 0; p + 8 <= len; p += 8) {
      const __m256 e = paged::exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), top8));
      _mm256_storeu_ps(scores + p, e);
      total = _mm256_add_ps(total, e);
    }
    _mm256_store_ps(lanes, total);
    float sum = 0.0f;
    for (const float lane : lanes) sum += lane;
    if (p < len) {
      const __m256 e = paged::exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), top8));
      _mm256_store_ps(lanes, e);
      for (int64_t j = 0; p + j < len; ++j) {
        scores[p + j] = lanes[j];
        sum += lanes[j];
      }
    }
    s.totals[h] = 1.0f / sum;
  }
  // A head at a time over whole rows: the first pass reads them from memory, the others from L2.
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
      const float* e = s.scores.data() + h * padded;
      float* out = o + h * head_dim;
      switch (std::min<int64_t>(64, head_dim - d0) / 8) {
        case 2: value_sums<2>(s.values.data(), e, len, d0, s.totals[h], out); break;
        case 4: value_sums<4>(s.values.data(), e, len, d0, s.totals[h], out); break;
        case 6: value_sums<6>(s.values.data(), e, len, d0, s.totals[h], out); break;
        default: value_sums<8>(s.values.data(), e, len, d0, s.totals[h], out); break;
      }
    }
}
#endif

}  // namespace

void paged_decode_attention(
    const torch::Tensor& q,             // [num_tokens, num_heads, head_dim], rows may be strided
    const torch::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, row]: row is
                                        // head_dim fp32 or bf16, or int8 codes + scales, offsets
    const torch::Tensor& v_cache,       // same
    const torch::Tensor& block_tables,  // int32 [num_seqs, max_blocks] (rows may repeat: stride 0)
    const torch::Tensor& seq_lens,      // int32 [num_seqs], keys to attend, the new one included
    const torch::Tensor& q_rows,        // int64 [num_seqs], the row of q holding each query
    torch::Tensor& out,                 // [num_tokens, num_heads, head_dim]
    double scale,
    bool invariant) {                   // in the batch-invariant order (attention_simd.h)
  const paged::Rows kind =
      paged::check_attention_args("paged_decode_attention", q, k_cache, v_cache, out, block_tables);
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && q_rows.scalar_type() == torch::kLong &&
              seq_lens.is_contiguous() && q_rows.is_contiguous() && q_rows.size(0) == num_seqs &&
              block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "paged_decode_attention: one int32 length, int64 row and block table row per "
              "sequence");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {  // (a loop: a tensor reduction costs microseconds)
    const int64_t row = rows[i], len = lens[i];
    max_len = std::max(max_len, len);
    TORCH_CHECK(row >= 0 && row < q.size(0) && row < out.size(0) && len >= 1 &&
                len <= block_tables.size(1) * k_cache.size(1), "paged_decode_attention: sequence ",
                i, "'s row ", row, " or length ", len, " is past q, out or its block table");
  }
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t table_stride = block_tables.stride(0);

  const float* q_ptr = q.data_ptr<float>();
  const char* k_ptr = static_cast<const char*>(k_cache.data_ptr());
  const char* v_ptr = static_cast<const char*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0);  // q is usually a view into the fused QKV output
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();  // one (token, KV head)
  const int64_t token_stride = num_kv_heads * row_bytes;  // between positions in a block
  const float fscale = static_cast<float>(scale);

#if defined(__AVX512F__)
  if (head_dim == 64 || head_dim == 128) {
    // One task per (sequence, KV head): its keys and values cross the memory bus once for all
    // the query heads that share them.
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      GroupScratch scratch;
      scratch.scores.resize(group * (max_len + 17));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / num_kv_heads, kv = task % num_kv_heads;
        const int64_t h = kv * group;  // the group's first query head
        const float* qh = q_ptr + rows[seq] * q_stride + h * head_dim;
        float* o = out_ptr + rows[seq] * num_heads * head_dim + h * head_dim;
        const int32_t* table = tables + seq * table_stride;
        const RowCursor keys{k_ptr + kv * row_bytes, table, block_size, token_stride};
        const RowCursor values{v_ptr + kv * row_bytes, table, block_size, token_stride};
        auto run = [&](auto dv, auto order) {
          constexpr int DV = decltype(dv)::value;
          constexpr bool kInvariant = decltype(order)::value;
          auto group_fn = kind == paged::Rows::Int8 ? decode_group<int8_t, DV, kInvariant>
                          : kind == paged::Rows::BF16 ? decode_group<c10::BFloat16, DV, kInvariant>
                                                      : decode_group<float, DV, kInvariant>;
          group_fn(qh, group, fscale, keys, values, lens[seq], scratch, o);
        };
        auto sized = [&](auto order) {
          if (head_dim == 64) run(std::integral_constant<int, 4>{}, order);
          else run(std::integral_constant<int, 8>{}, order);
        };
        if (invariant) sized(std::true_type{});
        else sized(std::false_type{});
      }
    });
    return;
  }
#endif

  const RowReader cache{kind, head_dim};
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (head_dim % 16 == 0) {
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      Avx2Scratch scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / num_kv_heads, kv = task % num_kv_heads;
        const int64_t h = kv * group;
        decode_group_avx2(q_ptr + rows[seq] * q_stride + h * head_dim, group, head_dim, fscale,
                          k_ptr + kv * row_bytes, v_ptr + kv * row_bytes,
                          tables + seq * table_stride, block_size, token_stride, lens[seq], cache,
                          scratch, out_ptr + rows[seq] * num_heads * head_dim + h * head_dim);
      }
    });
    return;
  }
#endif

  // One task per sequence: a cached token's rows for all KV heads lie side by side, read once
  // for all query heads.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> query(num_heads * head_dim);
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> row(num_kv_heads * head_dim);  // one position's rows, as fp32
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * table_stride;
      const float* q_row = q_ptr + rows[seq] * q_stride;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) query[i] = q_row[i] * fscale;
      scores.resize(num_heads * len);
      auto position = [&](const char* base, int64_t pos) {
        return base + (static_cast<int64_t>(table[pos / block_size]) * block_size +
                       pos % block_size) * token_stride;
      };

      for (int64_t pos = 0; pos < len; ++pos) {
        const char* keys = position(k_ptr, pos);
        for (int64_t kv = 0; kv < num_kv_heads; ++kv)
          cache.load(keys + kv * row_bytes, row.data() + kv * head_dim);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* key = row.data() + (h / group) * head_dim;
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
        const char* values = position(v_ptr, pos);
        for (int64_t kv = 0; kv < num_kv_heads; ++kv)
          cache.load(values + kv * row_bytes, row.data() + kv * head_dim);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* value = row.data() + (h / group) * head_dim;
          const float w = scores[h * len + pos];
          float* a = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * value[d];
        }
      }
      float* o = out_ptr + rows[seq] * num_heads * head_dim;
      std::copy(acc.begin(), acc.end(), o);
    }
  });
}


void paged_prefill_as_decodes(
    const torch::Tensor& q,            // as paged_decode_attention's
    const torch::Tensor& k_cache,      // the slice's new keys and values written already
    const torch::Tensor& v_cache,
    const torch::Tensor& block_table,  // int32 [blocks], the slice's sequence
    int64_t q_start, int64_t q_len,    // the slice's rows of q and out
    int64_t first_pos,                 // the position of its first token
    torch::Tensor& out, double scale) {
  paged::check_attention_args("paged_prefill_as_decodes", q, k_cache, v_cache, out, block_table);
  paged::check_slice("paged_prefill_as_decodes", q, out, block_table, k_cache.size(1), q_start,
                     q_len, first_pos);
  if (q_len == 0) return;
  // The prefill kernel's AVX-512 tiles keep the batch-invariant order (its AVX2 tiles do not).
#if defined(__AVX512F__)
  if (q.size(2) == 64 || q.size(2) == 128) {
    paged_prefill_attention(q, k_cache, v_cache, block_table, q_start, q_len, first_pos, out,
                            scale, true);
    return;
  }
#endif
  prefill_as_decode_rows(q, k_cache, v_cache, block_table, q_start, q_len, first_pos, out, scale,
                         true);
}

void prefill_as_decode_rows(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_table,
                            int64_t q_start, int64_t q_len, int64_t first_pos, torch::Tensor& out,
                            double scale, bool invariant) {
  if (q_len == 0) return;
  // Each token a row of the decode kernel, over the table repeated (stride 0), long and short
  // rows alternating so the tasks parallel_for hands each thread carry equal work.
  const auto t = torch::arange(q_len, torch::kLong);
  const auto order = torch::where(t % 2 == 0, t.div(2, "floor"), q_len - 1 - t.div(2, "floor"));
  paged_decode_attention(q, k_cache, v_cache, block_table.unsqueeze(0).expand({q_len, -1}),
                         (order + (first_pos + 1)).to(torch::kInt), order + q_start, out, scale,
                         invariant);
}
