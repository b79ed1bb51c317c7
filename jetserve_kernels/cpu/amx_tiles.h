// AMX tiles for the matmuls of a bf16 model (linear.cpp's tiles_run) and of int8 weights with int8
// activations (amx_quads_run), and a software model of the same instructions, so that the
// kernels' tiling can be checked bit for bit on a CPU without AMX.
//
// Both give the kernels one interface, with tile registers named by template arguments (the
// instructions take them as immediates):
//   configure<L>(), release()     the tiles' shapes (Layout L), for this thread
//   zero<T>()                     tile T = 0
//   load<T>(p, stride)            tile T's rows from p, p + stride, ... (bytes)
//   store<T>(p, stride)           the reverse
//   dot<C, A, B>()                C (16 x 16 fp32) += A (16 x 32 bf16) . B (16 pairs x 16 x 2 bf16)
//   dot_int8<C, A, B>()           C (16 x 16 int32) += A (16 rows x 4K unsigned bytes) .
//                                 B (K quads x 16 x 4 signed bytes)
// dot is tdpbf16ps. In the Intel SDM's pseudocode, for each output it sums the instruction's 16
// even products (A[m][2k] * B[k][2n], k in order) in one fp32 chain from zero and its 16 odd
// products in another, adds the two, and adds that to C: each step an FMA rounded to nearest
// even, inputs that are denormal taken as zero, results that are denormal flushed. So its order
// differs from vdpbf16ps's (one chain over the pairs, a pair's odd product first), and a tile
// and a vector kernel do not give the same bits: a process runs a bf16 model's matmuls on one or
// the other at every row count (services/executor/engine/linear.py). The model follows that
// pseudocode; whether the hardware does too is what `python -m
// services.executor.engine.amx_probe` prints. dot_int8 is tdpbusd: integer sums, exact in any
// order, the same as vpdpbusd's.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#if defined(__linux__) && defined(__x86_64__) && defined(__AVX512BF16__) && \
    (defined(__GNUC__) || defined(__clang__))
#define JETSERVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace amx {

// The tiles' shapes: Bf16, all 8 tiles 16 rows x 64 bytes; Int8Groups, for one group of 32
// values of k at a time: tiles 0-3 16 x 64 bytes (16 x 16 int32 sums), 4-5 16 rows x 32 bytes
// (16 rows of x's 32 codes), 6-7 8 rows x 64 bytes (the group's 8 quads of 16 columns).
enum class Layout { Bf16, Int8Groups };

// The tile configuration ldtilecfg reads (palette 1).
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit Config(Layout layout = Layout::Bf16) {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = layout == Layout::Int8Groups && (t == 4 || t == 5) ? 32 : 64;
      rows[t] = layout == Layout::Int8Groups && t >= 6 ? 8 : 16;
    }
  }
};

#if defined(JETSERVE_AMX)
// Whether this process may use AMX tiles with the CPUID.7.0:EDX bit `feature` (22 AMX-BF16, 25
// AMX-INT8): the CPU has it and the tiles (bit 24), and Linux grants the tile data state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process, for all its threads; it fails
// where the kernel has not enabled the state). Without the grant the first tile instruction
// would kill the process.
// Both asked once a process (the kernels check before every matmul that names the tiles, and
// in a VM each cpuid is a trip to the hypervisor): the features' bits, 0 without the grant.
inline bool available(int feature = 22) {
  static const unsigned features = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1)) return 0u;
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0 ? d : 0u;
  }();
  return (features >> feature) & 1;
}
inline bool available_int8() { return available(25); }

// The instructions, as their bytes (an assembler older than binutils 2.36 does not know their
// names, and the whole library would then fail to build), with the address in rax and the
// stride in rcx. VEX prefix C4 E2 (map 0F38), then W0 vvvv L0 pp, the opcode, ModRM (and SIB
// 0x08: [rax + rcx * 1]).
struct Tiles {
  template <Layout L>
  static void configure() {
    static const Config config(L);
    asm volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0x00" ::"a"(&config) : "memory");  // ldtilecfg [rax]
  }
  static void release() { asm volatile(".byte 0xc4, 0xe2, 0x78, 0x49, 0xc0" ::); }  // tilerelease
  template <int T>
  static void zero() {  // tilezero tmmT
    asm volatile(".byte 0xc4, 0xe2, 0x7b, 0x49, %c0" ::"i"(0xc0 | T << 3));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {  // tileloadd tmmT, [rax + rcx]
    asm volatile(".byte 0xc4, 0xe2, 0x7b, 0x4b, %c2, 0x08" ::"a"(p), "c"(stride), "i"(T << 3 | 4)
                 : "memory");
  }
  template <int T>
  static void store(void* p, int64_t stride) {  // tilestored [rax + rcx], tmmT
    asm volatile(".byte 0xc4, 0xe2, 0x7a, 0x4b, %c2, 0x08" ::"a"(p), "c"(stride), "i"(T << 3 | 4)
                 : "memory");
  }
  template <int C, int A, int B>
  static void dot() {  // tdpbf16ps tmmC, tmmA, tmmB (B in vvvv, inverted; pp F3)
    asm volatile(".byte 0xc4, 0xe2, %c0, 0x5c, %c1" ::"i"((~B & 15) << 3 | 2),
                 "i"(0xc0 | C << 3 | A));
  }
  template <int C, int A, int B>
  static void dot_int8() {  // tdpbusd tmmC, tmmA, tmmB (pp 66)
    asm volatile(".byte 0xc4, 0xe2, %c0, 0x5e, %c1" ::"i"((~B & 15) << 3 | 1),
                 "i"(0xc0 | C << 3 | A));
  }
};
#else
inline bool available(int = 22) { return false; }
inline bool available_int8() { return false; }
#endif

// The software model: eight 1 KB registers per thread, each of the configured shape (its rows
// of colsb bytes; the rest zero), the dot products in the SDM's order.
struct Model {
  struct alignas(64) Register {
    uint8_t bytes[16 * 64];
  };
  static Register* registers() {
    static thread_local Register file[8];
    return file;
  }
  static Config& config() {
    static thread_local Config shapes;
    return shapes;
  }
  template <Layout L>
  static void configure() {
    config() = Config(L);
  }
  static void release() {}
  template <int T>
  static void zero() {
    std::memset(registers()[T].bytes, 0, sizeof(Register));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    zero<T>();
    for (int r = 0; r < config().rows[T]; ++r)
      std::memcpy(registers()[T].bytes + r * 64, static_cast<const uint8_t*>(p) + r * stride,
                  config().colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    for (int r = 0; r < config().rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, registers()[T].bytes + r * 64,
                  config().colsb[T]);
  }
  // tdpbusd: each int32 of C plus its row of A's unsigned bytes times its column of B's signed
  // ones, a quad (4 k) at a time, over A's colsb / 4 quads (wrapping as the instruction does).
  template <int C, int A, int B>
  static void dot_int8() {
    int32_t c[16][16];
    uint8_t a[16][64];
    int8_t b[16][64];
    std::memcpy(c, registers()[C].bytes, sizeof c);
    std::memcpy(a, registers()[A].bytes, sizeof a);
    std::memcpy(b, registers()[B].bytes, sizeof b);
    const Config& shape = config();
    if (shape.colsb[A] / 4 != shape.rows[B] || shape.colsb[C] != shape.colsb[B] ||
        shape.rows[C] != shape.rows[A] || shape.colsb[A] % 4 != 0)
      throw std::logic_error("amx::Model::dot_int8: tile shapes tdpbusd would fault on");
    const int quads = shape.colsb[A] / 4;
    for (int m = 0; m < config().rows[C]; ++m)
      for (int n = 0; n < config().colsb[C] / 4; ++n) {
        uint32_t sum = static_cast<uint32_t>(c[m][n]);
        for (int k = 0; k < quads; ++k)
          for (int i = 0; i < 4; ++i)
            sum += static_cast<uint32_t>(int32_t{a[m][4 * k + i]} * int32_t{b[k][4 * n + i]});
        c[m][n] = static_cast<int32_t>(sum);
      }
    std::memcpy(registers()[C].bytes, c, sizeof c);
  }
  // A bf16 as fp32, a denormal as zero of its sign.
  static float widen(uint16_t h) {
    const uint32_t bits = (h & 0x7F80u) ? uint32_t(h) << 16 : uint32_t(h & 0x8000u) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  // A result as the instruction keeps it: a denormal flushed to zero of its sign.
  static float flushed(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  template <int C, int A, int B>
  static void dot() {
    float c[16][16];
    uint16_t a[16][32], b[16][32];
    std::memcpy(c, registers()[C].bytes, sizeof c);
    std::memcpy(a, registers()[A].bytes, sizeof a);
    std::memcpy(b, registers()[B].bytes, sizeof b);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        // volatile: each step rounded on its own, as the pseudocode has it, whatever
        // -ffast-math would otherwise reorder.
        volatile float even = 0.0f, odd = 0.0f;
        for (int k = 0; k < 16; ++k) {
          even = flushed(std::fma(widen(a[m][2 * k]), widen(b[k][2 * n]), even));
          odd = flushed(std::fma(widen(a[m][2 * k + 1]), widen(b[k][2 * n + 1]), odd));
        }
        volatile float both = flushed(even + odd);
        c[m][n] = flushed(c[m][n] + both);
      }
    std::memcpy(registers()[C].bytes, c, sizeof c);
  }
};

}  // namespace amx
