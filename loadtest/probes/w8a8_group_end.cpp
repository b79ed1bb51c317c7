// The W8A8 tile of jetserve_kernels/cpu/linear.cpp (AVX512-VNNI, 6 rows x a panel of 32
// columns, vpdpbusd over quads of k), on its own, with each group's end three ways: what bounds
// it (loadtest/kernel_probes.py).
//   full:     the kernel's arithmetic at each group's end (its requests for the next groups'
//             weights left out): int32 sums to fp32, times x's scale, times the weights' scale,
//             added, plus x's low times the weights' group sum;
//   folded:   the two scales multiplied first, then one FMA into the sums;
//   products: no group end at all (the int32 sums added as they are: wrong, the products' cost
//             alone).
// Weights are 30 distinct layers of random quads, as a model's stream from memory. Prints one
// JSON object: the best of `repeats` passes over every layer and GOP/s (two a product).
//
// Arguments: mode n k m repeats

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kPanel = 32, kGroup = 32, kQuads = kGroup / 4, kRows = 6, kLayers = 30;
enum Mode { kFull, kFolded, kProducts };

template <Mode M>
void tile(const uint8_t* q, const float* scale, const float* sums, int64_t k, const uint8_t* xu,
          const float* xs, const float* xlow, float* y, int64_t y_stride) {
  const int64_t groups = k / kGroup;
  __m512 lo[kRows], hi[kRows];
  for (int i = 0; i < kRows; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * kQuads * 4 * kPanel;
    __m512i sum_lo[kRows], sum_hi[kRows];
    for (int i = 0; i < kRows; ++i) sum_lo[i] = sum_hi[i] = _mm512_setzero_si512();
    for (int v = 0; v < kQuads; ++v) {
      const __m512i w_lo = _mm512_loadu_si512(qg + v * 4 * kPanel);
      const __m512i w_hi = _mm512_loadu_si512(qg + v * 4 * kPanel + 64);
      for (int i = 0; i < kRows; ++i) {
        int32_t quad;
        std::memcpy(&quad, xu + i * k + g * kGroup + v * 4, sizeof quad);
        const __m512i xv = _mm512_set1_epi32(quad);
        sum_lo[i] = _mm512_dpbusd_epi32(sum_lo[i], xv, w_lo);
        sum_hi[i] = _mm512_dpbusd_epi32(sum_hi[i], xv, w_hi);
      }
    }
    const __m512 s_lo = _mm512_loadu_ps(scale + g * kPanel);
    const __m512 s_hi = _mm512_loadu_ps(scale + g * kPanel + 16);
    const __m512 ws_lo = _mm512_loadu_ps(sums + g * kPanel);
    const __m512 ws_hi = _mm512_loadu_ps(sums + g * kPanel + 16);
    for (int i = 0; i < kRows; ++i) {
      const __m512 sx = _mm512_set1_ps(xs[i * groups + g]);
      const __m512 low = _mm512_set1_ps(xlow[i * groups + g]);
      if constexpr (M == kFull) {
        const __m512 d_lo = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum_lo[i]), sx), s_lo);
        const __m512 d_hi = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum_hi[i]), sx), s_hi);
        lo[i] = _mm512_fmadd_ps(ws_lo, low, _mm512_add_ps(d_lo, lo[i]));
        hi[i] = _mm512_fmadd_ps(ws_hi, low, _mm512_add_ps(d_hi, hi[i]));
      } else if constexpr (M == kFolded) {
        lo[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_lo[i]), _mm512_mul_ps(s_lo, sx), lo[i]);
        hi[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_hi[i]), _mm512_mul_ps(s_hi, sx), hi[i]);
        lo[i] = _mm512_fmadd_ps(ws_lo, low, lo[i]);
        hi[i] = _mm512_fmadd_ps(ws_hi, low, hi[i]);
      } else {
        lo[i] = _mm512_add_ps(lo[i], _mm512_castsi512_ps(sum_lo[i]));
        hi[i] = _mm512_add_ps(hi[i], _mm512_castsi512_ps(sum_hi[i]));
      }
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm512_storeu_ps(y + i * y_stride, lo[i]);
    _mm512_storeu_ps(y + i * y_stride + 16, hi[i]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: w8a8_group_end full|folded|products n k m repeats\n");
    return 2;
  }
  const std::string name = argv[1];
  const int64_t n = std::atoll(argv[2]), k = std::atoll(argv[3]), m = std::atoll(argv[4]);
  const int repeats = std::atoi(argv[5]);
  if ((name != "full" && name != "folded" && name != "products") || n <= 0 || k <= 0 || m <= 0 ||
      repeats <= 0 || n % kPanel || k % kGroup || m % kRows) {
    std::fprintf(stderr, "w8a8_group_end: mode full, folded or products; n a positive multiple "
                         "of 32, k of 32, m of 6; repeats positive\n");
    return 2;
  }
  const auto run = name == "full" ? tile<kFull> : name == "folded" ? tile<kFolded> : tile<kProducts>;
  const int64_t panels = n / kPanel, groups = k / kGroup;
  std::vector<std::vector<uint8_t>> q(kLayers, std::vector<uint8_t>(n * k));
  for (auto& layer : q)
    for (auto& b : layer) b = static_cast<uint8_t>(std::rand());
  std::vector<float> scale(panels * groups * kPanel, 0.01f), sums(panels * groups * kPanel, 0.5f);
  std::vector<uint8_t> xu(m * k);
  for (auto& b : xu) b = static_cast<uint8_t>(std::rand());
  std::vector<float> xs(m * groups, 0.1f), xlow(m * groups, -1.0f), y(m * n);
  double best = 1e30;
  for (int rep = 0; rep < repeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int l = 0; l < kLayers; ++l) {
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < panels; ++j)
        for (int64_t m0 = 0; m0 < m; m0 += kRows)
          run(q[l].data() + j * k * kPanel, scale.data() + j * groups * kPanel,
              sums.data() + j * groups * kPanel, k, xu.data() + m0 * k, xs.data() + m0 * groups,
              xlow.data() + m0 * groups, y.data() + m0 * n + j * kPanel, n);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("{\"mode\": \"%s\", \"n\": %lld, \"k\": %lld, \"m\": %lld, \"ms\": %.2f, "
              "\"gop_s\": %.1f}\n", name.c_str(), static_cast<long long>(n),
              static_cast<long long>(k), static_cast<long long>(m), best * 1e3,
              2.0 * m * n * k * kLayers / best / 1e9);
  return 0;
}
