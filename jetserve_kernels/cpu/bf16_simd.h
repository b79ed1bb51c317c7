// bfloat16 pairs for vdpbf16ps (AVX512-BF16 builds): one instruction makes 32 products of bf16
// pairs into 16 fp32 sums, where an FMA makes 16. Its operands hold two bf16 values in each
// 32-bit lane, the first in the low half. The matmuls (linear.cpp) and the attention kernels
// over a bf16 cache (attention_simd.h) build their operands here.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>

// Lane i: (even[i], odd[i]), each rounded to bf16 (nearest, ties to even): both rounded by one
// instruction (even's 16 in the low half, odd's in the high), then interleaved by one permute
// (two instructions where widening each half and merging them took six).
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                       21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave),
                                  reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even)));
}

// 16 values rounded to bf16 (nearest, ties to even), in order: 8 pairs.
inline __m256i bf16_bits(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }

// x rounded to bf16 as bf16_pairs rounds it, kept as fp32.
inline __m512 bf16_rounded(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x))), 16));
}

// Lane i: (a[i], b[i]) of two runs of 16 bf16 values.
inline __m512i interleave_bf16(const void* a, const void* b) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(a)));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(b)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// acc + a . b, pair by pair (the order of the two products within a lane is the instruction's).
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}
#endif
