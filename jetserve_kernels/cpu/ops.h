// The CPU kernels of the torch backend, built together into one extension
// (jetserve_kernels/cpu_ops.py).
#pragma once

#include <torch/extension.h>

// invariant: in the batch-invariant order (attention_simd.h), which paged_prefill_attention's
// AVX-512 tiles keep too when asked (invariant); otherwise in a cheaper one. (Without AVX-512,
// or at a head_dim other than 64 and 128, one order either way: AVX2 vectors or plain loops.)
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, const torch::Tensor& q_rows,
                            torch::Tensor& out, double scale, bool invariant);
// A prefill slice's tokens (rows [q_start, q_start + q_len) of q, positions from first_pos), each
// attended with the bits paged_decode_attention (invariant) gives it as a decode: what a
// batch-invariant (bf16) model runs. paged_prefill_attention's tiles where they keep that order
// (AVX-512, head_dim 64 or 128); elsewhere each token is a row of the decode kernel.
void paged_prefill_as_decodes(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_table,
                              int64_t q_start, int64_t q_len, int64_t first_pos,
                              torch::Tensor& out, double scale);
// Each of a prefill slice's tokens as a row of paged_decode_attention (in its invariant order
// or not, as asked), its inputs checked by the caller.
void prefill_as_decode_rows(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_table,
                            int64_t q_start, int64_t q_len, int64_t first_pos, torch::Tensor& out,
                            double scale, bool invariant);
// A prefill slice's causal attention over its cached context and its own new tokens (written to
// the cache already), for head_dim 64 or 128 where AVX-512, or AVX2 and FMA, is built in
// (prefill_attention_kernel). AVX-512 in the batch-invariant order: invariant, as
// paged_decode_attention's (over a bf16 or int8 cache, bf16 products where the CPU has them, and
// an int8 cache's keys in integer products);
// otherwise fp32 products over every cache. AVX2 in one order, whatever invariant says. A slice of
// 16 (token, query head) rows a KV head or fewer runs as rows of paged_decode_attention
// (prefill_as_decode_rows) in the order asked.
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& block_table,
                             int64_t q_start, int64_t q_len, int64_t first_pos, torch::Tensor& out,
                             double scale, bool invariant);
bool prefill_attention_kernel();

// Weights packed in panels of 32 output columns (services/executor/engine/linear.py, linear.cpp):
// fp32 [N / 32, K, 32]; int8 q [N / 32, K, 32] with fp32 scales [N / 32, K / 32, 32]; int4 q
// [N / 32, K, 16] with scales and mins. n: the output columns (the last panel may be padding).
// many_rows: "fp32", "bf16" or "amx", how many rows of x multiply quantized weights (linear.cpp).
torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& panels);
torch::Tensor linear_bf16_pairs(const torch::Tensor& x, const torch::Tensor& pairs, int64_t n,
                                const std::string& units);
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                          const std::string& many_rows);
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          int64_t n, const std::string& many_rows);
torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& min, int64_t n, const std::string& many_rows);
// int8 and int4 weights with int8 activations, the weights in quads of four k per column: W8A8 q
// int8 [N / 32, K / 4, 32, 4], W4A8 q uint8 [N / 32, K / 4, 16, 4] (column c low, c + 16 high;
// w = scale * (q - 8) + min); scales, mins and each group's sum of w [N / 32, K / 32, 32].
// second_byte: x's remainder in a second byte (about 16 bits of each group's range, twice the
// dot products); not used where many_rows "amx" takes the rows (from 49), which run in bf16.
// many_rows "amx_int8": from 16 rows on AMX-INT8 tiles (where the CPU has them and the build
// AVX512-BF16), "amx_int8_model" on their software model at every row count (builds with
// AVX512-VNNI): the same bits as the vector path.
torch::Tensor linear_w8a8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& sums, int64_t n, const std::string& many_rows,
                          bool second_byte);
torch::Tensor linear_w4a8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          const torch::Tensor& min, const torch::Tensor& sums, int64_t n,
                          const std::string& many_rows, bool second_byte);
// Whether this build has the AVX512-BF16 dot products ("bf16" above), int8 ones (linear_w8a8,
// linear_w4a8: AVX512-VNNI, or AVX2's vpmaddwd).
bool bf16_dot_products();
bool amx_bf16();
bool amx_int8();
bool int8_dot_products();
double dot_peak_flops(const std::string& kind, int64_t iters);

torch::Tensor rms_norm(const torch::Tensor& x, const torch::optional<torch::Tensor>& residual,
                       const torch::Tensor& weight, double eps);
void rotary_and_cache(torch::Tensor& qkv, const torch::Tensor& positions,
                      const torch::Tensor& cos_sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                      const torch::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
                      const torch::optional<torch::Tensor>& q_mul,
                      const torch::optional<torch::Tensor>& k_mul);
torch::Tensor silu_and_mul(const torch::Tensor& x);
