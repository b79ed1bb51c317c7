// AMX tiles for a bf16 model's matmuls (linear.cpp's tiles_run), and a software model of the
// same instructions, so that the kernel's tiling can be checked bit for bit on a CPU without AMX.
//
// Both give the kernel one interface, with tile registers named by template arguments (the
// instructions take them as immediates):
//   configure(), release()        every tile 16 rows of 64 bytes, for this thread
//   zero<T>()                     tile T = 0
//   load<T>(p, stride)            tile T's 16 rows from p, p + stride, ... (bytes)
//   store<T>(p, stride)           the reverse
//   dot<C, A, B>()                C (16 x 16 fp32) += A (16 x 32 bf16) . B (16 pairs x 16 x 2 bf16)
// dot is tdpbf16ps: C[m][n] += A[m][2k] * B[k][2n], then += A[m][2k + 1] * B[k][2n + 1], for k
// in order (a lane's low half first). A product of two bf16 is exact in fp32; each sum rounds to
// nearest even; inputs that are denormal count as zero, and a sum that is denormal becomes zero
// (the Intel SDM's pseudocode for the instruction). The model follows that pseudocode, and
// tests/kernels/test_cpu_ops.py checks the kernel on it against vdpbf16ps's bits on any CPU with
// AVX512-BF16; where the CPU has AMX, the engine checks the instructions' bits against
// vdpbf16ps's at load (services/executor/engine/linear.py) and the same test checks them too.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__AVX512BF16__) && (defined(__GNUC__) || defined(__clang__))
#define JETSERVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace amx {

// The tile configuration ldtilecfg reads (palette 1): 8 tiles of 16 rows x 64 bytes.
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  Config() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

#if defined(JETSERVE_AMX)
// Whether this process may use AMX-BF16: the CPU has it (CPUID.7.0:EDX bits 22 and 24) and Linux
// grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process,
// for all its threads). Without the grant the first tile instruction would kill the process.
inline bool available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// The instructions, as inline assembly (the intrinsics take tile numbers as macro arguments, and
// the "%c" modifier prints a template's constant as the register's number; AT&T | Intel syntax).
struct Tiles {
  static void configure() {
    static const Config config;
    asm volatile("ldtilecfg %0" ::"m"(config));
  }
  static void release() { asm volatile("tilerelease" ::); }
  template <int T>
  static void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    asm volatile("{tileloadd (%0,%1,1), %%tmm%c2|tileloadd %%tmm%c2, [%0+%1*1]}"
                 ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    asm volatile("{tilestored %%tmm%c2, (%0,%1,1)|tilestored [%0+%1*1], %%tmm%c2}"
                 ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  static void dot() {
    asm volatile("{tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2}"
                 ::"i"(C), "i"(A), "i"(B));
  }
};
#else
inline bool available() { return false; }
#endif

// The software model: eight 1 KB registers per thread, the dot product in the pseudocode's order.
struct Model {
  struct alignas(64) Register {
    uint8_t bytes[16 * 64];
  };
  static Register* registers() {
    static thread_local Register file[8];
    return file;
  }
  static void configure() {}
  static void release() {}
  template <int T>
  static void zero() {
    std::memset(registers()[T].bytes, 0, sizeof(Register));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r)
      std::memcpy(registers()[T].bytes + r * 64, static_cast<const uint8_t*>(p) + r * stride, 64);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, registers()[T].bytes + r * 64, 64);
  }
  // A bf16 as fp32, a denormal as zero of its sign.
  static float widen(uint16_t h) {
    const uint32_t bits = (h & 0x7F80u) ? uint32_t(h) << 16 : uint32_t(h & 0x8000u) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  // A sum as the instruction keeps it: rounded to fp32 (by the addition), a denormal flushed.
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
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 16; ++n) {
          // volatile: each product and each sum rounded on its own, as the pseudocode has it,
          // whatever -ffast-math would otherwise contract or reorder.
          volatile float even = widen(a[m][2 * k]) * widen(b[k][2 * n]);
          c[m][n] = flushed(c[m][n] + even);
          volatile float odd = widen(a[m][2 * k + 1]) * widen(b[k][2 * n + 1]);
          c[m][n] = flushed(c[m][n] + odd);
        }
    std::memcpy(registers()[C].bytes, c, sizeof c);
  }
};

}  // namespace amx
