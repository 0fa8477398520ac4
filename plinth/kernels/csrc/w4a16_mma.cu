// W4A16 decode GEMM on tensor cores: y[M, N] = x[M, K] @ ((q - z) * s)^T for M <= 8 * NB rows.
//
// Compiled at run time with NVRTC (plinth/quantization/kernels/w4a16_cuda.py); no CUDA headers are
// needed: 16-bit values travel as raw bits and every arithmetic instruction is inline PTX.
//
// The weight is the mma's A operand (16 output channels per mma), the activations its B operand
// (one batch row per B column), so one m16n8k16 instruction consumes 256 weights whatever the batch
// (up to 8 rows; NB = 2 reuses each unpacked A fragment for rows 8..15).
//
// Packed layout (made by pack_mma_codes in w4a16_cuda.py): 32-bit words [N/16][K/64][32 lanes][4 steps].
// A chunk is 64 input features; step s of a chunk is one mma. Lane l (g = l / 4, t = l % 4) holds,
// in nibble p of its word for step s, the weight of
//     row 16 * tile + g + 8 * (p % 2),   feature 64 * chunk + 16 * t + 4 * s + 2 * ((p / 2) % 2) + p / 4.
// Nibbles p and p + 4 become the two halves of A register p % 4 (p = 0..3) with one lop3 each, as the
// exact 16-bit numbers magic + q (magic = 128 in bfloat16, 1024 in float16), and one packed FMA
// subtracts magic + z, leaving the exact integers q - z (zero points must be integers). The features of
// one lane are 16 consecutive activations, read as the B registers of the four steps. The mma's k order
// is a permutation of the features, the same on both operands, so the dot products are unchanged.
//
// Scales: 32-bit words [N/16][groups][8][2] (rows g and g + 8 of a tile side by side), each the group's
// scale (low half) and zero point in code units (high half), both bfloat16. Each chunk's float32 sums
// of x * (q - z) are multiplied by the scale in float32: the weights are never rounded to 16 bits.

typedef unsigned int u32;
typedef unsigned short u16;

struct __align__(16) Words4 {
  u32 x, y, z, w;
};

// (a & b) | c
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

template <bool BF16>
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
  u32 d;
  if (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
  return d;
}

// v in both halves
template <bool BF16>
__device__ __forceinline__ u32 splat2(float v) {
  u32 d;
  if (BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(v));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(v));
  }
  return d;
}

// d = a b + c
template <bool BF16>
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1, const float* c) {
  if (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
}

template <bool BF16>
__device__ __forceinline__ u16 to_half(float v) {
  u16 h;
  if (BF16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  }
  return h;
}

__device__ __forceinline__ u32 shared_address(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return static_cast<u32>(a);
}

__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void copy_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(shared_address(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// One ring slot, in 16-byte words: a chunk's codes (32 lanes x 1), then its activations, 128 bytes per
// batch row (lane 4 g + t holds features 16 t .. 16 t + 15 of row g, and of row g + 8 when NB = 2); a
// slot has as many activation rows as the batch.
constexpr int kCodeWords4 = 32;

// Copy one chunk (codes at src, activations at xs[nb]) into a slot, every lane its own bytes.
template <int NB>
__device__ __forceinline__ void fetch(Words4* slot, const Words4* src, const Words4* const* xs, const bool* has_x,
                                      int lane) {
  copy_async16(slot + lane, src);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (has_x[nb]) {
      Words4* dst = slot + kCodeWords4 + (nb * 32 + lane) * 2;
      copy_async16(dst, xs[nb]);
      copy_async16(dst + 1, xs[nb] + 1);
    }
  }
}

__device__ __forceinline__ float as_float(u32 v) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(v));
  return f;
}
__device__ __forceinline__ float low_bf16(u32 v) { return as_float(v << 16); }
__device__ __forceinline__ float high_bf16(u32 v) { return as_float(v & 0xFFFF0000u); }

// a b + c, rounded once
__device__ __forceinline__ float fma_f32(float a, float b, float c) {
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}

// grid (N / 16), block (32 * warps), dynamic shared memory groups * 64 + warps * S * (512 + 128 * M) bytes.
// A block stages its tile's scales in shared memory, then its warps share the tile's K chunks in turn
// (chunk warp + warps * j, so that a block reads one contiguous stretch at a time). Each warp streams its
// chunks and their activations through its own ring of S slots with cp.async, S - 1 chunks in flight;
// every lane copies and reads only its own bytes, so no barrier is needed until the warps add their sums.
// Chunk cc's scale group is cc >> group_shift.
template <bool BF16, int NB, int S>
__global__ void __launch_bounds__(512) w4a16_mma_decode(
    const Words4* __restrict__ codes, const Words4* __restrict__ scales, const u16* __restrict__ x,
    u16* __restrict__ y, int M, int K, int ldx, int ldy, int group_shift, int groups) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int tile = blockIdx.x;
  const int chunks = K >> 6;
  const int mine = chunks > warp ? (chunks - warp + warps - 1) / warps : 0;
  const int slot_words = kCodeWords4 + 8 * min(M, 8 * NB);

  Words4* tile_scales = reinterpret_cast<Words4*>(shared);   // groups x 4 words: [8][2] u32 per group
  Words4* ring = tile_scales + groups * 4 + warp * S * slot_words;
  const Words4* scale_src = scales + (size_t)tile * groups * 4;
  for (int i = threadIdx.x; i < groups * 4; i += blockDim.x) copy_async16(tile_scales + i, scale_src + i);

  const Words4* src = codes + ((size_t)tile * chunks + warp) * 32 + lane;
  const size_t src_step = (size_t)warps * 32;
  const Words4* xs[NB];
  bool has_x[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int row = g + 8 * nb;
    has_x[nb] = row < M;
    xs[nb] = reinterpret_cast<const Words4*>(x + (size_t)(has_x[nb] ? row : 0) * ldx) + 2 * t + warp * 8;
  }
  const int x_step = warps * 8;

#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < mine) {
      const Words4* xi[NB];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) xi[nb] = xs[nb] + i * x_step;
      fetch<NB>(ring + i * slot_words, src + i * src_step, xi, has_x, lane);
    }
    commit_copies();
  }
  wait_copies<S - 2>();   // the first group (with the scales) is complete for this thread ...
  __syncthreads();        // ... and for every thread

  const u32 magic = BF16 ? 0x43004300u : 0x64006400u;
  const u32 one = BF16 ? 0x3F803F80u : 0x3C003C00u;
  const float magic_f = BF16 ? 128.f : 1024.f;
  const float zero4[4] = {0.f, 0.f, 0.f, 0.f};
  float out[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) out[nb][0] = out[nb][1] = out[nb][2] = out[nb][3] = 0.f;

  int read = 0;        // the slot of this iteration's chunk
  int write = S - 1;   // the slot consumed one iteration ago
  for (int j = 0; j < mine; ++j) {
    const int cc = warp + warps * j;
    wait_copies<S - 2>();   // S - 1 + j groups committed: this chunk's is complete
    const Words4* slot = ring + read * slot_words;
    const Words4 w = slot[lane];
    Words4 xa[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      xa[nb][0] = has_x[nb] ? slot[kCodeWords4 + (nb * 32 + lane) * 2] : Words4{0u, 0u, 0u, 0u};
      xa[nb][1] = has_x[nb] ? slot[kCodeWords4 + (nb * 32 + lane) * 2 + 1] : Words4{0u, 0u, 0u, 0u};
    }
    if (j + S - 1 < mine) {
      const Words4* xi[NB];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) xi[nb] = xs[nb] + (j + S - 1) * x_step;
      fetch<NB>(ring + write * slot_words, src + (j + S - 1) * src_step, xi, has_x, lane);
    }
    commit_copies();
    write = read;
    read = read + 1 == S ? 0 : read + 1;

    const u32* sz = reinterpret_cast<const u32*>(tile_scales + (cc >> group_shift) * 4) + 2 * g;
    const u32 sz0 = sz[0], sz1 = sz[1];   // rows g and g + 8: scale (low half), zero point (high half)

    const u32 nz_g = splat2<BF16>(-(high_bf16(sz0) + magic_f));   // -(magic + z), rows g and g + 8
    const u32 nz_g8 = splat2<BF16>(-(high_bf16(sz1) + magic_f));
    float aq[2][NB][4];   // sum x * (q - z), even and odd steps
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const u32 v = words[s];
      u32 a[4];
      a[0] = fma2<BF16>(and_or(v, 0x000F000Fu, magic), one, nz_g);
      a[1] = fma2<BF16>(and_or(v >> 4, 0x000F000Fu, magic), one, nz_g8);
      a[2] = fma2<BF16>(and_or(v >> 8, 0x000F000Fu, magic), one, nz_g);
      a[3] = fma2<BF16>(and_or(v >> 12, 0x000F000Fu, magic), one, nz_g8);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const Words4& lo = xa[nb][s >> 1];
        const u32 b0 = (s & 1) ? lo.z : lo.x;
        const u32 b1 = (s & 1) ? lo.w : lo.y;
        mma16816<BF16>(aq[s & 1][nb], a, b0, b1, s < 2 ? zero4 : aq[s & 1][nb]);
      }
    }
    const float s_g = low_bf16(sz0), s_g8 = low_bf16(sz1);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        out[nb][i] = fma_f32(i < 2 ? s_g : s_g8, aq[0][nb][i] + aq[1][nb][i], out[nb][i]);
      }
    }
  }
  wait_copies<0>();

  if (warps > 1) {
    // each warp's sums go to the start of its own ring (at least 1 KiB), which no other warp writes
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");   // every lane has read its last slot
    float* own = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) own[(nb * 4 + i) * 32 + lane] = out[nb][i];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = 0.f;
        for (int w2 = 0; w2 < warps; ++w2) {
          sum += reinterpret_cast<const float*>(tile_scales + groups * 4 + w2 * S * slot_words)
              [(nb * 4 + i) * 32 + lane];
        }
        out[nb][i] = sum;
      }
    }
  }
  // C fragment: c0, c1 at (channel g, batch rows 2t, 2t + 1), c2, c3 at channel g + 8.
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 8 * nb + 2 * t + (i & 1);
      const int channel = 16 * tile + g + 8 * (i >> 1);
      if (row < M) y[(size_t)row * ldy + channel] = to_half<BF16>(out[nb][i]);
    }
  }
}
