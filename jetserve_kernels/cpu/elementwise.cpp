// The per-layer element-wise ops of the CPU path (fp32; the KV cache fp32, bf16 or int8), each one
// pass over its rows: in torch each is a chain of small ops, and at decode batch sizes the dispatch
// of those ops costs more than their arithmetic. Semantics are those of jetserve_kernels/reference.py.

#include "ops.h"
#include "attention_simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.stride(1) == 1, name,
              ": fp32 [T, C] with contiguous rows expected");
}

// Each head's head_dim floats of x as an int8 cache row (jetserve_kernels/kv_int8.py): for each
// group of 32, offset = fp16((min + max) / 2), scale = fp16(reach / 127) with reach the larger
// distance from the rounded offset to min or max (both clamped to fp16's range), codes
// round((x - offset) / scale) clamped to [-127, 127]; the codes, then each group's scale and
// offset.
void quantize_heads(const float* x, int64_t heads, int64_t head_dim, char* out) {
  const int64_t row = paged::int8_row_bytes(head_dim), size = paged::int8_group(head_dim);
  for (int64_t h = 0; h < heads; ++h, x += head_dim, out += row) {
    for (int64_t g = 0; g < head_dim / size; ++g) {
      const float* v = x + g * size;
      float lo = v[0], hi = v[0];
      for (int64_t d = 1; d < size; ++d) lo = std::min(lo, v[d]), hi = std::max(hi, v[d]);
      constexpr float kHalfMax = 65504.0f;  // clamped: past it fp16 is inf, and inf * 0 NaN
      const c10::Half offset(std::clamp((lo + hi) / 2.0f, -kHalfMax, kHalfMax));
      const float mid = static_cast<float>(offset);
      const c10::Half scale(std::min(std::max(hi - mid, mid - lo) / 127.0f, kHalfMax));
      const float step = static_cast<float>(scale);
      const float inv = step > 0.0f ? 1.0f / step : 0.0f;
      int8_t* codes = reinterpret_cast<int8_t*>(out) + g * size;
      for (int64_t d = 0; d < size; ++d)
        codes[d] = static_cast<int8_t>(
            std::clamp(std::nearbyint((v[d] - mid) * inv), -127.0f, 127.0f));
      std::memcpy(out + head_dim + 4 * g, &scale.x, 2);
      std::memcpy(out + head_dim + 4 * g + 2, &offset.x, 2);
    }
  }
}

// One head into an int8 cache's key basis (jetserve_kernels/kv_int8.py, to_key_basis_): times its
// multipliers, then where `rotate` the unnormalized Walsh-Hadamard transform, butterflies of
// distance 1, 2, 4, ... in that order, each sum and difference one fp32 rounding (the torch
// reference's bits). With AVX-512, 16 channels a register: the distances under 16 pair lanes
// of one register (a permute, then the lower lane of each pair takes the sum and the upper the
// difference), the longer ones pair whole registers.
void to_key_basis(float* x, const float* mul, int64_t head_dim, bool rotate) {
#if defined(__AVX512F__)
  if (rotate && head_dim % 16 == 0) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t c = 0; c < head_dim; c += 16) {
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + c), _mm512_loadu_ps(mul + c));
      asm volatile("" : "+v"(v));  // rounded here: not fused into the first sum (-ffp-contract)
      for (int h = 1; h < 16; h *= 2) {
        const __m512i distance = _mm512_set1_epi32(h);
        const __m512 partner = _mm512_permutexvar_ps(_mm512_xor_si512(lane, distance), v);
        const __mmask16 upper = _mm512_test_epi32_mask(lane, distance);
        v = _mm512_mask_sub_ps(_mm512_add_ps(v, partner), upper, partner, v);
      }
      _mm512_storeu_ps(x + c, v);
    }
    for (int64_t h = 16; h < head_dim; h *= 2)
      for (int64_t i = 0; i < head_dim; i += 2 * h)
        for (int64_t j = i; j < i + h; j += 16) {
          const __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + h);
          _mm512_storeu_ps(x + j, _mm512_add_ps(a, b));
          _mm512_storeu_ps(x + j + h, _mm512_sub_ps(a, b));
        }
    return;
  }
#endif
  for (int64_t d = 0; d < head_dim; ++d) x[d] *= mul[d];
  if (!rotate) return;
  for (int64_t h = 1; h < head_dim; h *= 2)
    for (int64_t i = 0; i < head_dim; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::optional<torch::Tensor>& residual,
                       const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight size");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = torch::empty({rows, cols}, x.options());
  float* res = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "rms_norm: residual shape");
    res = residual->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = res ? residual->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * xs;
      float* o = op + r * cols;
      const float* src = xr;
      if (res) {  // residual += x, and the sum is what gets normalized
        float* rr = res + r * rs;
        for (int64_t c = 0; c < cols; ++c) rr[c] += xr[c];
        src = rr;
      }
      float squares = 0.0f;
      for (int64_t c = 0; c < cols; ++c) squares += src[c] * src[c];
      const float inv = 1.0f / std::sqrt(squares / cols + feps);
      for (int64_t c = 0; c < cols; ++c) o[c] = src[c] * inv * wp[c];
    }
  });
  return out;
}

void rotary_and_cache(torch::Tensor& qkv, const torch::Tensor& positions,
                      const torch::Tensor& cos_sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                      const torch::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                      const torch::optional<torch::Tensor>& q_mul,
                      const torch::optional<torch::Tensor>& k_mul) {
  check_rows(qkv, "rotary_and_cache qkv");
  // An int8 cache row is head_dim int8 codes and their groups' fp16 scales and offsets
  // (jetserve_kernels/kv_int8.py).
  const bool int8 = k_cache.scalar_type() == torch::kInt8;
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  const int64_t head_dim = int8 ? paged::int8_head_dim(k_cache.size(3)) : k_cache.size(3);
  const int64_t half = head_dim / 2;
  TORCH_CHECK(!int8 || (head_dim > 0 && head_dim % paged::int8_group(head_dim) == 0 &&
                        k_cache.size(3) == paged::int8_row_bytes(head_dim)),
              "rotary_and_cache: an int8 cache needs head_dim under ", paged::kInt8Group,
              " or a multiple of it");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "rotary_and_cache: width");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
              (int8 || bf16 || k_cache.scalar_type() == torch::kFloat32) &&
              v_cache.scalar_type() == k_cache.scalar_type() && cos_sin.is_contiguous() &&
              cos_sin.size(1) == head_dim, "rotary_and_cache: cache or table layout");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && slot_mapping.scalar_type() == torch::kLong,
              "rotary_and_cache: int64 positions and slots");
  // The key basis (an int8 cache's, kv_int8.py): q and k moved into it in place after rotary.
  TORCH_CHECK(q_mul.has_value() == k_mul.has_value(), "rotary_and_cache: q_mul and k_mul together");
  const float* qm = nullptr;
  const float* km = nullptr;
  if (q_mul.has_value()) {
    for (const torch::Tensor* m : {&*q_mul, &*k_mul})
      TORCH_CHECK(m->scalar_type() == torch::kFloat32 && m->is_contiguous() && m->dim() == 2 &&
                  m->size(0) == num_kv_heads && m->size(1) == head_dim,
                  "rotary_and_cache: key basis multipliers fp32 [num_kv_heads, head_dim]");
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "rotary_and_cache: heads");
    qm = q_mul->data_ptr<float>();
    km = k_mul->data_ptr<float>();
  }
  const bool rotate = head_dim > 1 && (head_dim & (head_dim - 1)) == 0;
  const int64_t group = qm ? num_heads / num_kv_heads : 1;
  const int64_t tokens = qkv.size(0), stride = qkv.stride(0);
  const int64_t kv_width = num_kv_heads * head_dim;
  float* base = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t slot_bytes = num_kv_heads * k_cache.size(3) * k_cache.element_size();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + pos[t] * head_dim;
      const float* sin = cos + half;
      float* row = base + t * stride;
      // q heads then k heads: NeoX rotate-half, [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        float* x = row + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * cos[i] - x2 * sin[i];
          x[i + half] = x2 * cos[i] + x1 * sin[i];
        }
      }
      if (qm) {
        for (int64_t h = 0; h < num_heads; ++h)
          to_key_basis(row + h * head_dim, qm + h / group * head_dim, head_dim, rotate);
        for (int64_t h = 0; h < num_kv_heads; ++h)
          to_key_basis(row + (num_heads + h) * head_dim, km + h * head_dim, head_dim, rotate);
      }
      const float* k = row + num_heads * head_dim;
      if (int8) {
        quantize_heads(k, num_kv_heads, head_dim, kc + slots[t] * slot_bytes);
        quantize_heads(k + kv_width, num_kv_heads, head_dim, vc + slots[t] * slot_bytes);
      } else if (bf16) {  // rounded to nearest even
        std::copy(k, k + kv_width, reinterpret_cast<c10::BFloat16*>(kc + slots[t] * slot_bytes));
        std::copy(k + kv_width, k + 2 * kv_width,
                  reinterpret_cast<c10::BFloat16*>(vc + slots[t] * slot_bytes));
      } else {
        std::copy(k, k + kv_width, reinterpret_cast<float*>(kc + slots[t] * slot_bytes));
        std::copy(k + kv_width, k + 2 * kv_width,
                  reinterpret_cast<float*>(vc + slots[t] * slot_bytes));
      }
    }
  });
}

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_rows(x, "silu_and_mul x");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  auto out = torch::empty({rows, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * xs;
      const float* up = gate + d;
      float* o = op + r * d;
      for (int64_t c = 0; c < d; ++c) o[c] = gate[c] / (1.0f + std::exp(-gate[c])) * up[c];
    }
  });
  return out;
}
