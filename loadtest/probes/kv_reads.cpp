// Plain reads of a paged KV cache, in the order decode attention walks it, with none of its
// arithmetic: how fast this memory gives up rows scattered in blocks (loadtest/kernel_probes.py).
//
// A layer's K and V caches are [blocks, block_size, kv_heads, row_bytes], the engine's layout;
// each sequence's blocks are shuffled over the pool. Every row read is summed into a register
// (so that none is optimised away) and asked for `ahead` positions before its use into L2, as
// the kernel asks. Orders:
//   head:   a task per (sequence, KV head) reads its keys, then its values, one row a position
//           (the decode kernel's order: a head's rows are row_bytes at a stride of a token's);
//   token:  a task per sequence reads every KV head's row of a position together (whole
//           tokens, contiguous within a block);
//   block:  a task per sequence reads a block's positions for one KV head after another, then
//           the next block (what a kernel keeping its per-head loops could do);
//   head_major: as head, over blocks laid out [blocks, kv_heads, block_size, row_bytes] (a
//           head's rows of a block contiguous).
// Prints one JSON object: the best of `repeats` passes over every layer, and GB/s of rows read.
//
// Arguments: order seqs len block_size kv_heads row_bytes layers huge_pages repeats

#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int64_t kAhead = 32;  // positions a row is asked for before its use (the kernel's)

char* cache_of(size_t bytes, bool huge) {
  constexpr size_t kHuge = 2 << 20;
  bytes = (bytes + kHuge - 1) / kHuge * kHuge;
  char* p = static_cast<char*>(std::aligned_alloc(kHuge, bytes));
  if (p == nullptr) {
    std::fprintf(stderr, "kv_reads: out of memory for %zu bytes\n", bytes);
    std::exit(1);
  }
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 1, bytes);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: kv_reads order seqs len block_size kv_heads row_bytes layers "
                         "huge_pages repeats\n");
    return 2;
  }
  const std::string order = argv[1];
  const int64_t seqs = std::atoll(argv[2]), len = std::atoll(argv[3]);
  const int64_t block_size = std::atoll(argv[4]), heads = std::atoll(argv[5]);
  const int64_t row = std::atoll(argv[6]), layers = std::atoll(argv[7]);
  const bool huge = std::atoi(argv[8]) != 0;
  const int repeats = std::atoi(argv[9]);
  if ((order != "head" && order != "token" && order != "block" && order != "head_major") ||
      row <= 0 || row % 64 != 0 || seqs <= 0 || len <= 0 || block_size <= 0 || heads <= 0 ||
      layers <= 0 || repeats <= 0) {
    std::fprintf(stderr, "kv_reads: order is head, token, block or head_major; row_bytes a "
                         "positive multiple of 64; every count positive\n");
    return 2;
  }
  const int64_t seq_blocks = (len + block_size - 1) / block_size;
  const int64_t block_bytes = block_size * heads * row;
  std::vector<int32_t> table(seqs * seq_blocks);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
  std::shuffle(table.begin(), table.end(), std::mt19937(1));
  std::vector<char*> k(layers), v(layers);
  for (int64_t l = 0; l < layers; ++l) {
    k[l] = cache_of(table.size() * block_bytes, huge);
    v[l] = cache_of(table.size() * block_bytes, huge);
  }

  const bool head_major = order == "head_major";
  // Positions a task takes for one KV head before the next: all of them, or a block's.
  const int64_t span = order == "block" ? block_size : len;
  auto row_at = [&](const char* base, const int32_t* blocks, int64_t pos, int64_t h) {
    const int64_t b = blocks[pos / block_size], o = pos % block_size;
    return base + b * block_bytes + (head_major ? h * block_size + o : o * heads + h) * row;
  };
  auto read = [&](const char* base, const int32_t* blocks, int64_t p, int64_t h, __m512& acc) {
    if (p + kAhead < len) {
      const char* next = row_at(base, blocks, p + kAhead, h);
      for (int64_t c = 0; c < row; c += 64) _mm_prefetch(next + c, _MM_HINT_T1);
    }
    const char* r = row_at(base, blocks, p, h);
    for (int64_t c = 0; c < row; c += 64)
      acc = _mm512_add_ps(acc, _mm512_loadu_ps(reinterpret_cast<const float*>(r + c)));
  };
  // Sums the rows [0, len) of heads [h0, h0 + nh) of one cache in the order's turn.
  auto walk = [&](const char* base, const int32_t* blocks, int64_t h0, int64_t nh, __m512& acc) {
    if (order == "token") {
      for (int64_t p = 0; p < len; ++p)
        for (int64_t h = h0; h < h0 + nh; ++h) read(base, blocks, p, h, acc);
      return;
    }
    for (int64_t p0 = 0; p0 < len; p0 += span)
      for (int64_t h = h0; h < h0 + nh; ++h)
        for (int64_t p = p0; p < std::min(len, p0 + span); ++p) read(base, blocks, p, h, acc);
  };

  const bool per_token = order == "token" || order == "block";
  const int64_t tasks = per_token ? seqs : seqs * heads;
  double best = 1e30;
  float kept = 0.0f;
  for (int rep = 0; rep < repeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t l = 0; l < layers; ++l) {
#pragma omp parallel for schedule(static) reduction(+ : kept)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t seq = per_token ? task : task / heads;
        const int64_t h0 = per_token ? 0 : task % heads, nh = per_token ? heads : 1;
        const int32_t* blocks = table.data() + seq * seq_blocks;
        __m512 acc = _mm512_setzero_ps();
        walk(k[l], blocks, h0, nh, acc);
        walk(v[l], blocks, h0, nh, acc);
        kept += _mm512_reduce_add_ps(acc);
      }
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double bytes = 2.0 * layers * seqs * len * heads * row;
  std::printf("{\"order\": \"%s\", \"seqs\": %lld, \"len\": %lld, \"block_size\": %lld, "
              "\"huge_pages\": %s, \"ms\": %.2f, \"gb_s\": %.2f, \"kept\": %d}\n",
              order.c_str(), static_cast<long long>(seqs), static_cast<long long>(len),
              static_cast<long long>(block_size), huge ? "true" : "false", best * 1e3,
              bytes / best / 1e9, kept != 0.0f);
  return 0;
}
