// Launch and packing sweep of the FP8 E4M3 -> bf16 dequantize kernel (out = round_to<bf16>(code *
// scale_inv)), to pick the fastest shape on an H200. Not part of the CMake build; from the repo root:
//
//   mkdir -p build && nvcc -O3 -std=c++17 -arch=sm_90a -I include -I src benchmarks/cuda/dequant_sweep.cu -o build/dequant_sweep && build/dequant_sweep
//
// (-arch must name the GPU it runs on: the program refuses any other.) Prints one markdown table
// per size; with $OUT set, also writes them to $OUT/dequant_sweep.md.
//
// Every variant is dequant_kernel<Cfg<...>>: THREADS per block, packs of N codes (8: 8 bytes in, one
// 16-byte store; 16: one 16-byte load, two 16-byte stores), G packs held in registers at once, PACKS
// packs per thread in a block's chunk (a loop of PACKS / G round trips), one block per chunk unless
// "one wave". Pack u of a thread starts at chunk_begin + (u * THREADS + tid) * N, as in the library's
// multi_tensor_kernel. The conversion is the library's own (word_pack.cuh: load_pack, decode_pack,
// round_pack, store_pack); cache-hinted variants replace only the whole-pack vector access.
// Options (enum Flag; named in the table's config column): __launch_bounds__ min blocks,
// ld.global.nc.L1::no_allocate loads, st.global.cs stores, 32-bit indices, one wave of blocks,
// no tail code (whole chunks only: what a static-shape Triton kernel with XBLOCK | numel compiles
// to; the remainder of an odd size is then a second launch), and a whole-chunk fast path (the
// same code for whole aligned chunks, the general code for the last one, in one launch).
//
// Two more kinds of row: kPrefetch256 loads (the L2 fetches 256 bytes at once), and bulk_dequant_kernel
// (TMA bulk copies through shared memory, described at the kernel).
//
// Rows: "lib" is the library's configuration in this template (static_asserts below tie it to
// cast_cuda.cu's constants); "lib_real" is the library itself, fp8amp::cuda::dequantize, whose
// source this file includes (so a difference between the single-tensor template and the library's
// multi-tensor kernel shows).
// Rows marked TRAFFIC ONLY are the memory roof: the same loads and stores without the conversion.
//
// Checks, before any timing, per size: "lib"'s output equals numerics.h's reference on the host,
// every other row's output equals "lib"'s (memcmp), and nothing past the n outputs is written.
// Any difference prints MISMATCH and exits 1. Input: random bytes with all 256 codes (NaNs 0x7F and
// 0xFF included), scale_inv = 2^-3; sizes 16384 x 4096, 4096 x 4096 and 16384 x 4096 + 13 (the tail).
//
// Timing: CUDA events around 10 back-to-back launches (their mean is one sample), in interleaved
// rounds (each round times every row once, starting at a different row each round), 5 warm-up
// rounds then 30 timed; the table shows the median sample. Launches rotate over enough buffer sets
// that their bytes exceed 4x the L2 cache, so no launch reads the previous one's data from L2.
// GB/s counts 3n bytes (n codes read, 2n bytes written); "copy" is cudaMemcpyAsync device to
// device of 2n bytes (4n bytes moved) at the same size, rotated and timed the same way. "vs lib" is
// the median over rounds of lib's time / the row's time: above 1 is faster than lib.
// Times are direct launches, not CUDA-graph replays as in bench_cast.py (52.0 us lib, 51.2 us
// torch.compile at 16384 x 4096): compare rows within this table.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

// The library's dequantize (row lib_real) and, through it, word_pack.cuh and numerics.h.
#include "cast/cast_cuda.cu"

#define CUDA_CHECK(expr)                                                                               \
  do {                                                                                                 \
    const cudaError_t status_ = (expr);                                                                \
    if (status_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "CUDA error: %s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(status_), \
                   __FILE__, __LINE__);                                                                \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

namespace sweep {

using E4M3 = fp8amp::numerics::fp8_e4m3;
using BF16 = fp8amp::numerics::bf16;
using fp8amp::cuda::ceil_div;
using fp8amp::cuda::decode_pack;
using fp8amp::cuda::is_aligned;
using fp8amp::cuda::kWords;
using fp8amp::cuda::load_pack;
using fp8amp::cuda::round_pack;
using fp8amp::cuda::store_pack;
using fp8amp::cuda::valid_count;

// Options of a variant, or-ed into Cfg's FLAGS.
enum Flag : unsigned {
  kNoAllocate = 1,  // whole-pack loads as ld.global.nc.L1::no_allocate (else load_pack's ld.global)
  kStreaming = 2,   // whole-pack stores as st.global.cs (else store_pack's st.global.wb)
  kIndex32 = 4,     // 32-bit element indices, as Triton uses below 2^31 elements
  kOneWave = 8,     // grid = resident blocks x SMs, each block striding over the chunks
  kNoTail = 16,     // whole aligned chunks only, no tail or alignment code compiled (a static-shape
                    // Triton kernel has no masks when XBLOCK divides numel); a remainder, if any,
                    // is a second launch, of lib's kernel
  kWholeFastPath = 32,  // one launch; a block whose chunk is whole and aligned takes the no-tail
                        // code, the others the general code (kNoTail without the second launch)
  kPrefetch256 = 64,    // kNoAllocate's loads with .L2::256B: the L2 fetches the whole 256-byte
                        // sector group that a warp's 8-byte loads cover (one DRAM burst)
  kTrafficOnly = 128,   // not a dequantize: the same loads and stores, each code zero-extended to 16
                        // bits (two byte permutes a word) instead of converted, so the row measures
                        // the memory traffic alone; its output is checked against the codes
};

template <int THREADS, int N, int G, int PACKS, unsigned FLAGS = 0, int MIN_BLOCKS = 1>
struct Cfg {
  static constexpr int kThreads = THREADS;
  static constexpr int kN = N;                   // codes per pack: 8 or 16
  static constexpr int kG = G;                   // packs held at once
  static constexpr int kPacks = PACKS;           // packs per thread in a chunk
  static constexpr unsigned kFlags = FLAGS;
  static constexpr int kMinBlocks = MIN_BLOCKS;  // __launch_bounds__'s second argument (1: no limit)
  static constexpr int64_t kChunk = int64_t{THREADS} * PACKS * N;
  static_assert(N == 8 || N == 16, "8 or 16 codes a pack");
  static_assert(PACKS % G == 0, "PACKS is a multiple of G");
};

// The library's configuration, tied to cast_cuda.cu's constants.
using LibCfg = Cfg<256, 8, 2, 2>;
using LibOp = fp8amp::cuda::DequantizeOp<E4M3, BF16>;
static_assert(fp8amp::cuda::kThreads == LibCfg::kThreads && fp8amp::cuda::kPackSize<LibOp> == LibCfg::kN &&
                  fp8amp::cuda::kPacksInFlight<LibOp> == LibCfg::kG &&
                  fp8amp::cuda::kPacksPerThread<LibOp> == LibCfg::kPacks &&
                  fp8amp::cuda::kChunkSize<LibOp> == LibCfg::kChunk,
              "the library's dequantize configuration changed: update LibCfg");

// load_pack, with the whole-pack vector load optionally through the non-coherent path.
template <unsigned FLAGS, int N>
__device__ __forceinline__ void load_codes(const E4M3* p, int valid, bool vector_ok,
                                           uint32_t (&w)[kWords<E4M3, N>]) {
  if constexpr ((FLAGS & kPrefetch256) != 0) {
    static_assert(N == 8, "the prefetching load is 8 bytes");
    if (vector_ok && valid == N) {
      asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
      return;
    }
  } else if constexpr ((FLAGS & kNoAllocate) != 0) {
    if (vector_ok && valid == N) {
      if constexpr (kWords<E4M3, N> == 2) {
        asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
      } else {
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
            : "l"(p));
      }
      return;
    }
  }
  load_pack<N>(p, valid, vector_ok, w);
}

// store_pack of N bf16 values in 16-byte pieces (one for N = 8, two for N = 16), the whole pieces
// optionally as streaming stores.
template <unsigned FLAGS, int N>
__device__ __forceinline__ void store_values(BF16* p, const uint32_t (&w)[kWords<BF16, N>], int valid,
                                             bool vector_ok) {
  constexpr int M = 8;  // values per 16-byte piece
#pragma unroll
  for (int q = 0; q < N / M; ++q) {
    uint32_t piece[kWords<BF16, M>];
#pragma unroll
    for (int i = 0; i < kWords<BF16, M>; ++i) piece[i] = w[q * kWords<BF16, M> + i];
    const int piece_valid = N == M ? valid : max(0, min(M, valid - q * M));
    if constexpr ((FLAGS & kStreaming) != 0) {
      if (vector_ok && piece_valid == M) {
        __stcs(reinterpret_cast<uint4*>(p + q * M), make_uint4(piece[0], piece[1], piece[2], piece[3]));
        continue;
      }
    }
    store_pack<M>(p + q * M, piece, piece_valid, vector_ok);
  }
}

// The body of multi_tensor_kernel<DequantizeOp<E4M3, bf16>> for one tensor, with its shape as
// template parameters.
template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    dequant_kernel(const E4M3* in, BF16* out, int64_t n, const float* scale_inv) {
  using Index = std::conditional_t<(C::kFlags & kIndex32) != 0, int32_t, int64_t>;
  constexpr int N = C::kN, G = C::kG;
  constexpr Index kChunk = static_cast<Index>(C::kChunk);
  const float factor = *scale_inv;
  const bool vector_ok = is_aligned(in, N * sizeof(E4M3)) && is_aligned(out, N * sizeof(BF16));

  // Chunk [begin, end); whole: known to be kChunk long and aligned, so no tail code is compiled.
  const auto convert_chunk = [&](Index begin, Index end, auto whole) {
    constexpr bool kWhole = decltype(whole)::value;
    for (int u0 = 0; u0 < C::kPacks; u0 += G) {
      if (!kWhole && begin + (u0 * C::kThreads + static_cast<int>(threadIdx.x)) * N >= end) break;
      Index j[G];
      int valid[G];
      uint32_t x[G][kWords<E4M3, N>];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        j[g] = begin + ((u0 + g) * C::kThreads + static_cast<int>(threadIdx.x)) * N;
        valid[g] = kWhole ? N : valid_count<N>(j[g], end);
        load_codes<C::kFlags, N>(in + j[g], valid[g], kWhole || vector_ok, x[g]);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        uint32_t w[kWords<BF16, N>];
        if constexpr ((C::kFlags & kTrafficOnly) != 0) {
#pragma unroll
          for (int i = 0; i < kWords<E4M3, N>; ++i) {
            w[2 * i] = __byte_perm(x[g][i], 0, 0x4140);  // codes 0, 1 -> 16-bit 0, 1
            w[2 * i + 1] = __byte_perm(x[g][i], 0, 0x4342);
          }
        } else {
          float v[N];
          decode_pack<E4M3>(x[g], v);
#pragma unroll
          for (int k = 0; k < N; ++k) v[k] *= factor;
          round_pack<BF16>(v, w);
        }
        store_values<C::kFlags, N>(out + j[g], w, valid[g], kWhole || vector_ok);
      }
    }
  };

  const Index chunks = static_cast<Index>(ceil_div(n, C::kChunk));
  for (Index c = blockIdx.x; c < chunks; c += gridDim.x) {
    const Index begin = c * kChunk;
    const Index end = min(static_cast<Index>(n), begin + kChunk);
    if constexpr ((C::kFlags & kNoTail) != 0) {
      convert_chunk(begin, end, std::true_type{});
    } else if ((C::kFlags & kWholeFastPath) != 0 && vector_ok && end - begin == kChunk) {
      convert_chunk(begin, end, std::true_type{});
    } else {
      convert_chunk(begin, end, std::false_type{});
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bulk-copy (TMA, cp.async.bulk, sm_90) variant: can the copy engine's whole-chunk transfers move
// more bytes per second than threads' 8-byte loads and 16-byte stores? Persistent blocks (as many
// as fit, at most one per chunk) take chunks c = blockIdx.x + i * gridDim.x of CODES codes: one
// thread issues each chunk's bulk load into one of STAGES shared buffers (an mbarrier counts its
// bytes), the block converts it into a shared bf16 buffer, and one thread issues its bulk store.
// Loads run STAGES chunks ahead; a values buffer is rewritten once the store that read it (STAGES
// chunks back) is done reading. Whole chunks only, 16-byte aligned: the rest is lib's kernel.

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* full) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(full)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(full))
               : "memory");
}

__device__ __forceinline__ void wait_full(uint64_t* full, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(full)), "r"(parity)
        : "memory");
  } while (done == 0);
}

template <int CODES, int STAGES>
__global__ void __launch_bounds__(256) bulk_dequant_kernel(const E4M3* in, BF16* out, int64_t chunks,
                                                           const float* scale_inv) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* codes_s = smem;            // STAGES x CODES bytes
  BF16* values_s = reinterpret_cast<BF16*>(smem + STAGES * CODES);  // STAGES x CODES values
  __shared__ __align__(8) uint64_t full[STAGES];
  constexpr int N = 8;  // codes a thread converts at a time
  const float factor = *scale_inv;
  const int64_t step = gridDim.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int s = 0; s < STAGES; ++s) {
      const int64_t c = blockIdx.x + s * step;
      if (c < chunks) bulk_load(codes_s + s * CODES, in + c * CODES, CODES, &full[s]);
    }
  }
  __syncthreads();
  int64_t i = 0;
  for (int64_t c = blockIdx.x; c < chunks; c += step, ++i) {
    const int s = static_cast<int>(i % STAGES);
    wait_full(&full[s], static_cast<uint32_t>((i / STAGES) & 1));
    // At most STAGES - 1 stores still reading: the one from values_s[s] is done.
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(STAGES - 1) : "memory");
    __syncthreads();
    const unsigned char* cs = codes_s + s * CODES;
    BF16* vs = values_s + s * CODES;
#pragma unroll 4
    for (int k = threadIdx.x * N; k < CODES; k += 256 * N) {
      uint32_t x[kWords<E4M3, N>];
      const uint2 raw = *reinterpret_cast<const uint2*>(cs + k);
      x[0] = raw.x;
      x[1] = raw.y;
      float v[N];
      decode_pack<E4M3>(x, v);
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] *= factor;
      uint32_t w[kWords<BF16, N>];
      round_pack<BF16>(v, w);
      *reinterpret_cast<uint4*>(vs + k) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    // The values written through the generic proxy, visible to the bulk store's async proxy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(out + c * CODES),
                   "r"(smem_addr(vs)), "r"(static_cast<uint32_t>(2 * CODES))
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      const int64_t next = c + STAGES * step;  // codes_s[s] is free: every thread is past it
      if (next < chunks) bulk_load(codes_s + s * CODES, in + next * CODES, CODES, &full[s]);
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// The rows: the template's variants, the library itself, and the copy they are measured against.

using KernelFn = void (*)(const E4M3*, BF16*, int64_t, const float*);
enum class Kind { kKernel, kLibrary, kBulk, kCopy };

struct Variant {
  std::string name, config;
  Kind kind = Kind::kKernel;
  KernelFn kernel = nullptr;  // for kBulk, bulk_dequant_kernel (its third argument counts chunks)
  int smem = 0;               // dynamic shared memory a block (kBulk)
  int threads = 0;
  int64_t chunk = 0;
  unsigned flags = 0;
  int regs = 0, resident = 0;  // registers a thread, blocks a SM (filled in main)
};

template <class C>
Variant variant(const char* name) {
  Variant v;
  v.name = name;
  v.config = std::to_string(C::kThreads) + " thr, N=" + std::to_string(C::kN) + ", G=" + std::to_string(C::kG) +
             ", " + std::to_string(C::kPacks) + " packs/thr";
  if (C::kMinBlocks > 1) v.config += ", launch_bounds min " + std::to_string(C::kMinBlocks);
  if (C::kFlags & kNoAllocate) v.config += ", ld.nc.L1::no_allocate";
  if (C::kFlags & kStreaming) v.config += ", st.cs";
  if (C::kFlags & kIndex32) v.config += ", int32 index";
  if (C::kFlags & kOneWave) v.config += ", one wave";
  if (C::kFlags & kNoTail) v.config += ", no tail code";
  if (C::kFlags & kWholeFastPath) v.config += ", whole-chunk fast path";
  if (C::kFlags & kPrefetch256) v.config += ", ld.nc.L1::no_allocate.L2::256B";
  if (C::kFlags & kTrafficOnly) v.config += ", TRAFFIC ONLY (codes zero-extended, no conversion)";
  v.kernel = dequant_kernel<C>;
  v.threads = C::kThreads;
  v.chunk = C::kChunk;
  v.flags = C::kFlags;
  return v;
}

template <int CODES, int STAGES>
Variant bulk_variant(const char* name) {
  Variant v;
  v.name = name;
  v.config = "bulk copies, 256 thr, " + std::to_string(CODES) + "-code chunks, " + std::to_string(STAGES) +
             " stages, persistent";
  v.kind = Kind::kBulk;
  v.kernel = bulk_dequant_kernel<CODES, STAGES>;
  v.smem = 3 * CODES * STAGES;
  v.threads = 256;
  v.chunk = CODES;
  v.flags = kNoTail;  // whole chunks; the rest by lib's kernel
  return v;
}

std::vector<Variant> all_variants() {
  Variant lib_real;
  lib_real.name = "lib_real";
  lib_real.config = "fp8amp::cuda::dequantize (the library itself)";
  lib_real.kind = Kind::kLibrary;
  lib_real.threads = fp8amp::cuda::kThreads;
  lib_real.chunk = fp8amp::cuda::kChunkSize<LibOp>;
  //              THREADS, N, G, PACKS, FLAGS, MIN_BLOCKS
  return {
      variant<LibCfg>("lib"),  // first: the others are checked against it
      lib_real,
      variant<Cfg<256, 8, 1, 1>>("t256_g1"),
      variant<Cfg<128, 8, 1, 1>>("t128_g1"),  // Inductor's shape: XBLOCK 1024, 4 warps
      variant<Cfg<128, 8, 2, 2>>("t128_g2"),
      variant<Cfg<512, 8, 1, 1>>("t512_g1"),
      variant<Cfg<512, 8, 2, 2>>("t512_g2"),
      variant<Cfg<256, 8, 1, 4>>("t256_g1_p4"),
      variant<Cfg<256, 8, 2, 8>>("t256_g2_p8"),  // the library before one round trip a thread
      variant<Cfg<256, 16, 1, 1>>("v16_t256"),   // 16-byte loads of codes, two 16-byte stores
      variant<Cfg<128, 16, 1, 1>>("v16_t128"),
      variant<Cfg<256, 8, 2, 2, 0, 8>>("lib_lb8"),
      variant<Cfg<128, 8, 1, 1, 0, 16>>("t128_g1_lb16"),
      variant<Cfg<256, 8, 2, 2, kNoAllocate>>("lib_nc"),
      variant<Cfg<256, 8, 2, 2, kStreaming>>("lib_cs"),
      variant<Cfg<256, 8, 2, 2, kNoAllocate | kStreaming>>("lib_nc_cs"),
      variant<Cfg<128, 8, 1, 1, kNoAllocate | kStreaming>>("t128_g1_nc_cs"),
      variant<Cfg<256, 8, 2, 2, kIndex32>>("lib_i32"),
      variant<Cfg<128, 8, 1, 1, kIndex32>>("t128_g1_i32"),
      variant<Cfg<256, 8, 2, 2, kOneWave>>("lib_1wave"),
      variant<Cfg<256, 8, 2, 2, kNoTail>>("lib_notail"),
      variant<Cfg<128, 8, 1, 1, kNoTail>>("t128_g1_notail"),
      variant<Cfg<256, 8, 2, 2, kNoTail | kIndex32>>("lib_i32_notail"),
      variant<Cfg<128, 8, 1, 1, kNoTail | kIndex32>>("t128_g1_i32_notail"),  // nearest to Triton's
      variant<Cfg<256, 8, 2, 2, kWholeFastPath>>("lib_fast"),
      variant<Cfg<256, 8, 2, 2, kWholeFastPath | kIndex32>>("lib_i32_fast"),
      variant<Cfg<128, 8, 1, 1, kWholeFastPath | kIndex32>>("t128_g1_i32_fast"),
      variant<Cfg<256, 8, 2, 2, kPrefetch256 | kStreaming>>("lib_pf_cs"),
      variant<Cfg<128, 8, 1, 1, kPrefetch256 | kStreaming>>("t128_g1_pf_cs"),
      bulk_variant<4096, 4>("bulk_c4k_s4"),
      bulk_variant<4096, 8>("bulk_c4k_s8"),
      bulk_variant<8192, 4>("bulk_c8k_s4"),
      bulk_variant<16384, 2>("bulk_c16k_s2"),
      bulk_variant<2048, 8>("bulk_c2k_s8"),
      // The memory roof of this access pattern: lib's and the fastest rows' loads and stores alone.
      variant<Cfg<256, 8, 2, 2, kTrafficOnly>>("lib_traffic"),
      variant<Cfg<256, 8, 2, 2, kNoAllocate | kStreaming | kTrafficOnly>>("lib_nc_cs_traffic"),
      variant<Cfg<128, 8, 1, 1, kNoAllocate | kStreaming | kTrafficOnly>>("t128_g1_nc_cs_traffic"),
  };
}

// One size's buffers: `sets` copies of input and output, each output with a guard past its 2n bytes.
constexpr size_t kGuard = 256;
constexpr unsigned char kFill = 0xA5;
constexpr float kScaleInv = 0.125f;  // 2^-3

struct Buffers {
  int64_t n = 0;
  int sets = 0;
  std::vector<E4M3*> in;
  std::vector<BF16*> out;
  float* scale_inv = nullptr;
};

int g_sms = 0;

// The grid of variant v over n elements: one block per chunk, or at most one wave.
unsigned grid_blocks(const Variant& v, int64_t n) {
  int64_t blocks = std::max<int64_t>(1, ceil_div(n, v.chunk));
  if ((v.flags & kOneWave) || v.kind == Kind::kBulk) blocks = std::min<int64_t>(blocks, int64_t{v.resident} * g_sms);
  if (blocks > INT32_MAX) {
    std::fprintf(stderr, "dequant_sweep: %lld blocks are too many for one launch\n", static_cast<long long>(blocks));
    std::exit(1);
  }
  return static_cast<unsigned>(blocks);
}

// Elements [body, n) by lib's kernel: the rest after a variant that takes whole chunks only.
void run_rest(const Buffers& b, const E4M3* in, BF16* out, int64_t body, cudaStream_t stream) {
  if (body >= b.n) return;
  const auto blocks = static_cast<unsigned>(ceil_div(b.n - body, LibCfg::kChunk));
  dequant_kernel<LibCfg><<<blocks, LibCfg::kThreads, 0, stream>>>(in + body, out + body, b.n - body, b.scale_inv);
  CUDA_CHECK(cudaGetLastError());
}

void run(const Variant& v, const Buffers& b, int set, cudaStream_t stream) {
  E4M3* in = b.in[set];
  BF16* out = b.out[set];
  switch (v.kind) {
    case Kind::kKernel: {
      // A no-tail kernel takes the whole chunks; lib's kernel the rest (a second launch).
      const int64_t body = v.flags & kNoTail ? b.n / v.chunk * v.chunk : b.n;
      if ((v.flags & kNoTail) && !(is_aligned(in, 16) && is_aligned(out, 32))) {
        std::fprintf(stderr, "dequant_sweep: %s needs 16-byte aligned codes and 32-byte aligned output\n",
                     v.name.c_str());
        std::exit(1);
      }
      if (body > 0 || !(v.flags & kNoTail)) {
        v.kernel<<<grid_blocks(v, body), v.threads, 0, stream>>>(in, out, body, b.scale_inv);
        CUDA_CHECK(cudaGetLastError());
      }
      run_rest(b, in, out, body, stream);
      break;
    }
    case Kind::kBulk: {
      const int64_t chunks = b.n / v.chunk, body = chunks * v.chunk;
      if (chunks > 0) {
        v.kernel<<<grid_blocks(v, body), v.threads, v.smem, stream>>>(in, out, chunks, b.scale_inv);
        CUDA_CHECK(cudaGetLastError());
      }
      run_rest(b, in, out, body, stream);
      break;
    }
    case Kind::kLibrary:
      fp8amp::cuda::dequantize(fp8amp::DType::kFloat8E4M3, fp8amp::DType::kBFloat16, {{in, out, b.n}}, b.scale_inv,
                               stream);
      break;
    case Kind::kCopy:
      CUDA_CHECK(cudaMemcpyAsync(out, b.out[(set + 1) % b.sets], 2 * b.n, cudaMemcpyDeviceToDevice, stream));
      break;
  }
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t m = x.size() / 2;
  return x.size() % 2 ? x[m] : 0.5 * (x[m - 1] + x[m]);
}

// Runs every variant once on set 0 and compares its output with lib's (lib's with numerics.h's).
void check_outputs(const std::vector<Variant>& variants, const Buffers& b, const std::vector<uint8_t>& codes,
                   const char* label, cudaStream_t stream) {
  uint16_t lut[256];
  for (int c = 0; c < 256; ++c) {
    lut[c] = fp8amp::numerics::round_to<BF16>(
                 fp8amp::rn::mul(fp8amp::numerics::to_float(E4M3{static_cast<uint8_t>(c)}), kScaleInv))
                 .bits;
  }
  const size_t bytes = 2 * static_cast<size_t>(b.n);
  std::vector<uint16_t> lib(b.n + kGuard / 2), got(b.n + kGuard / 2);
  for (size_t i = 0; i < variants.size(); ++i) {
    const Variant& v = variants[i];
    CUDA_CHECK(cudaMemsetAsync(b.out[0], kFill, bytes + kGuard, stream));
    run(v, b, 0, stream);
    CUDA_CHECK(cudaMemcpyAsync(got.data(), b.out[0], bytes + kGuard, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    // lib against numerics.h's reference, element by element; a traffic-only row against the codes
    // zero-extended; the others against lib's bytes.
    const bool traffic = (v.flags & kTrafficOnly) != 0;
    const auto want = [&](int64_t k) -> uint16_t {
      return i == 0 ? lut[codes[k]] : traffic ? uint16_t{codes[k]} : lib[k];
    };
    const bool same = i == 0 || traffic ? [&] {
      for (int64_t k = 0; k < b.n; ++k) {
        if (got[k] != want(k)) return false;
      }
      return true;
    }()
                                        : std::memcmp(got.data(), lib.data(), bytes) == 0;
    if (!same) {
      int64_t e = 0;
      while (got[e] == want(e)) ++e;
      std::printf("MISMATCH: %s at %s: element %lld (code 0x%02X) is 0x%04X, %s 0x%04X\n", v.name.c_str(), label,
                  static_cast<long long>(e), codes[e], got[e],
                  i == 0 ? "numerics.h reference" : traffic ? "the code" : "lib", want(e));
      std::exit(1);
    }
    const uint8_t* guard = reinterpret_cast<const uint8_t*>(got.data()) + bytes;
    for (size_t g = 0; g < kGuard; ++g) {
      if (guard[g] != kFill) {
        std::printf("MISMATCH: %s at %s wrote byte %zu past the output\n", v.name.c_str(), label, g);
        std::exit(1);
      }
    }
    if (i == 0) lib = got;
  }
}

std::string fmt(const char* f, double x) {
  char s[64];
  std::snprintf(s, sizeof(s), f, x);
  return s;
}

// Times every variant and the copy at one size; returns the markdown section.
std::string sweep_size(std::vector<Variant>& variants, int64_t n, const char* label, int l2_bytes,
                       cudaStream_t stream) {
  Buffers b;
  b.n = n;
  b.sets = static_cast<int>(std::max<int64_t>(2, ceil_div(4 * int64_t{l2_bytes}, 3 * n)));
  std::vector<uint8_t> codes(n);
  std::mt19937_64 rng(42);
  for (int64_t e = 0; e < n; e += 8) {
    const uint64_t r = rng();
    std::memcpy(&codes[e], &r, static_cast<size_t>(std::min<int64_t>(8, n - e)));
  }
  for (int c = 0; c < 256 && c < n; ++c) codes[c] = static_cast<uint8_t>(c);  // every code, NaNs included
  for (int s = 0; s < b.sets; ++s) {
    E4M3* in = nullptr;
    BF16* out = nullptr;
    CUDA_CHECK(cudaMalloc(&in, n));
    CUDA_CHECK(cudaMalloc(&out, 2 * n + kGuard));
    CUDA_CHECK(cudaMemcpy(in, codes.data(), n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(out, 0, 2 * n + kGuard));
    b.in.push_back(in);
    b.out.push_back(out);
  }
  CUDA_CHECK(cudaMalloc(&b.scale_inv, sizeof(float)));
  CUDA_CHECK(cudaMemcpy(b.scale_inv, &kScaleInv, sizeof(float), cudaMemcpyHostToDevice));

  check_outputs(variants, b, codes, label, stream);

  // Interleaved rounds over the variants and the copy (the last row).
  constexpr int kWarmup = 5, kRounds = 30, kLaunches = 10;
  Variant copy;
  copy.name = "copy";
  copy.kind = Kind::kCopy;
  std::vector<const Variant*> rows;
  for (const Variant& v : variants) rows.push_back(&v);
  rows.push_back(&copy);
  const int R = static_cast<int>(rows.size());
  std::vector<cudaEvent_t> events(2 * R * kRounds);
  for (cudaEvent_t& e : events) CUDA_CHECK(cudaEventCreate(&e));
  int64_t launch = 0;  // rotates the buffer sets over consecutive launches
  for (int r = 0; r < kWarmup + kRounds; ++r) {
    for (int k = 0; k < R; ++k) {
      const int row = (k + r) % R;
      const int t = r - kWarmup;
      if (t >= 0) CUDA_CHECK(cudaEventRecord(events[2 * (t * R + row)], stream));
      for (int l = 0; l < kLaunches; ++l) run(*rows[row], b, static_cast<int>(launch++ % b.sets), stream);
      if (t >= 0) CUDA_CHECK(cudaEventRecord(events[2 * (t * R + row) + 1], stream));
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<std::vector<double>> us(R, std::vector<double>(kRounds));
  for (int t = 0; t < kRounds; ++t) {
    for (int row = 0; row < R; ++row) {
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, events[2 * (t * R + row)], events[2 * (t * R + row) + 1]));
      us[row][t] = 1e3 * ms / kLaunches;
    }
  }
  for (cudaEvent_t& e : events) CUDA_CHECK(cudaEventDestroy(e));

  const double copy_us = median(us[R - 1]);
  const double copy_gbs = 4.0 * n / (copy_us * 1e3);
  std::string md = std::string("### ") + label + " (n = " + std::to_string(n) + "): copy " + fmt("%.1f", copy_us) +
                   " us for 4n bytes = " + fmt("%.0f", copy_gbs) + " GB/s; " + std::to_string(b.sets) +
                   " buffer sets\n\n";
  md += "| variant | config | grid | regs | blocks/SM | us | GB/s | % of copy | vs lib |\n";
  md += "|---|---|---|---|---|---|---|---|---|\n";
  for (int row = 0; row < R - 1; ++row) {
    const Variant& v = *rows[row];
    const bool split = (v.flags & kNoTail) && n % v.chunk != 0;
    std::string blocks = std::to_string(grid_blocks(v, split ? n / v.chunk * v.chunk : n));
    if (split) blocks += " + tail";
    const double t = median(us[row]);
    const double gbs = 3.0 * n / (t * 1e3);
    std::vector<double> ratio(kRounds);
    for (int k = 0; k < kRounds; ++k) ratio[k] = us[0][k] / us[row][k];
    md += "| " + v.name + " | " + v.config + " | " + blocks + " | " + std::to_string(v.regs) +
          " | " + std::to_string(v.resident) + " | " + fmt("%.2f", t) + " | " + fmt("%.0f", gbs) + " | " +
          fmt("%.1f %%", 100.0 * gbs / copy_gbs) + " | " + fmt("%.3fx", median(ratio)) + " |\n";
  }

  for (int s = 0; s < b.sets; ++s) {
    CUDA_CHECK(cudaFree(b.in[s]));
    CUDA_CHECK(cudaFree(b.out[s]));
  }
  CUDA_CHECK(cudaFree(b.scale_inv));
  return md;
}

int main_body() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major != 9 || prop.minor != 0) {  // the build's -arch=sm_90a runs on sm_90 only
    std::fprintf(stderr, "dequant_sweep: built for sm_90a, but %s is sm_%d%d; rebuild with its -arch\n", prop.name,
                 prop.major, prop.minor);
    return 1;
  }
  g_sms = prop.multiProcessorCount;

  std::vector<Variant> variants = all_variants();
  for (Variant& v : variants) {
    const void* fn = v.kind == Kind::kLibrary
                         ? reinterpret_cast<const void*>(fp8amp::cuda::multi_tensor_kernel<LibOp>)
                         : reinterpret_cast<const void*>(v.kernel);
    cudaFuncAttributes attr{};
    CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
    v.regs = attr.numRegs;
    if (v.kind == Kind::kBulk) {  // beyond 48 KB a block (static and dynamic together) needs the opt-in
      CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
    }
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v.resident, fn, v.threads, v.smem));
  }

  struct Size {
    int64_t n;
    const char* label;
  };
  const Size sizes[] = {{int64_t{16384} * 4096, "16384 x 4096"},
                        {int64_t{4096} * 4096, "4096 x 4096"},
                        {int64_t{16384} * 4096 + 13, "16384 x 4096 + 13"}};
  for (const Size& s : sizes) {  // the int32-index variants need every index below 2^31
    if (s.n + (int64_t{1} << 20) > INT32_MAX) {
      std::fprintf(stderr, "dequant_sweep: %s is too large for the int32-index variants\n", s.label);
      return 1;
    }
  }

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::string md = std::string("## FP8 E4M3 -> bf16 dequantize sweep on ") + prop.name + " (" +
                   std::to_string(g_sms) + " SMs, L2 " + std::to_string(prop.l2CacheSize >> 20) +
                   " MiB)\n\nMedian of 30 interleaved rounds, each the mean of 10 back-to-back launches; " +
                   "GB/s counts 3n bytes; vs lib = median over rounds of lib time / row time (> 1: faster). " +
                   "All outputs bit-identical to lib (checked).\n\n";
  for (const Size& s : sizes) {
    md += sweep_size(variants, s.n, s.label, prop.l2CacheSize, stream) + "\n";
    std::fprintf(stderr, "dequant_sweep: %s done\n", s.label);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));

  std::printf("%s", md.c_str());
  if (const char* dir = std::getenv("OUT")) {
    const std::string path = std::string(dir) + "/dequant_sweep.md";
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fputs(md.c_str(), f) < 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "dequant_sweep: could not write %s\n", path.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace sweep

int main() {
  try {
    return sweep::main_body();
  } catch (const std::exception& e) {  // fp8amp::Error from the library's launcher
    std::fprintf(stderr, "dequant_sweep: %s\n", e.what());
    return 1;
  }
}
