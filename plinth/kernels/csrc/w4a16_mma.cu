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
// exact 16-bit numbers magic + q (magic = 128 in bfloat16, 1024 in float16; float16's registers 1 and 3
// take their nibbles where they lie, as 1024 + 16 q), and one packed FMA scales by 1 (1 / 16) and
// subtracts magic + z (magic / 16 + z), leaving the exact integers q - z (zero points must be integers). The features of
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

// v rounded to the nearest 16-bit value (bfloat16 or float16), as float32
template <bool BF16>
__device__ __forceinline__ float round16(float v) {
  const u16 h = to_half<BF16>(v);
  float f;
  if (BF16) {
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(static_cast<u32>(h) << 16));
  } else {
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  }
  return f;
}

// silu(gate) * up = gate / (1 + exp(-gate)) * up in float32
__device__ __forceinline__ float silu_mul(float gate, float up) {
  float e, q;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(gate * -1.4426950408889634f));
  asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(gate), "f"(1.f + e));
  return q * up;
}

__device__ __forceinline__ u32 shared_address(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return static_cast<u32>(a);
}

// 16 bytes from global to shared memory (a shared-space address), bypassing L1
__device__ __forceinline__ void copy_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// the same, only where on != 0
__device__ __forceinline__ void copy_async16_if(u32 dst, const void* src, int on) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}\n" ::"r"(dst),
      "l"(src), "r"(on)
      : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ Words4 load_shared16(u32 addr) {
  Words4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

template <int PENDING>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// With programmatic dependent launch the kernel may start while the previous kernel of the stream is
// still running: everything before this waits only on weights (which no kernel of a decode step writes);
// activations are read after it. Without such a launch it returns at once.
__device__ __forceinline__ void wait_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float as_float(u32 v) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(v));
  return f;
}

// a b + c, rounded once
__device__ __forceinline__ float fma_f32(float a, float b, float c) {
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}

// grid (N / 16), block (32 * warps), dynamic shared memory groups * 192 + warps * S * (512 + 128 * R) bytes,
// R = min(M, 8 * NB) activation rows per slot.
//
// A block first stages its tile's scales in shared memory (while the codes of its first chunks are on
// their way: neither depends on the previous kernel, see wait_previous_kernel) and turns each (scale,
// zero point) into the 16 bytes a lane reads per chunk: the float32 scales of rows g and g + 8 and the packed -(magic + z) of
// each (float16: -(magic / 16 + z) for rows g + 8, see the loop). Its warps then share the tile's K chunks in turn (chunk warp + warps * j, so that a block reads
// one contiguous stretch at a time). Each warp streams its chunks through its own ring of S slots with
// cp.async, S - 1 chunks in flight; a slot holds the chunk's codes (512 bytes) and activations (128
// bytes per batch row: lane 4 g + t copies features 16 t .. 16 t + 15 of rows g and g + 8). Every lane
// copies and reads only its own bytes, so no barrier is needed until the warps add their sums.
// Chunk cc's scale group is cc >> group_shift.
//
// Paired rows (pair_half = D > 0, a gate/up layer of N = 2 D packed by pack_mma_codes(pair_rows(...))):
// tile r holds gate rows 8 r .. 8 r + 7 as its rows g and up rows D + 8 r + g as its rows g + 8, so one
// lane ends with a gate sum and its up sum. With silu == 0 the outputs are stored at their own channels
// (y [M, N], as from unpaired rows); with silu != 0 the lane stores silu(gate) * up (y [M, D]), both
// rounded to 16 bits first, as a separate SiLU-and-mul kernel would read them.
template <bool BF16, int NB, int S>
__global__ void __launch_bounds__(512) w4a16_mma_decode(
    const Words4* __restrict__ codes, const u32* __restrict__ scales, const u16* __restrict__ x,
    u16* __restrict__ y, int M, int K, int ldx, int ldy, int group_shift, int groups, int pair_half, int silu) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int tile = blockIdx.x;
  const int chunks = K >> 6;
  const int mine = chunks > warp ? (chunks - warp + warps - 1) / warps : 0;
  const int xrows = min(M, 8 * NB);
  const u32 slot_bytes = 512u + 128u * xrows;

  // shared memory: per group 128 bytes of converted scales and 64 of raw ones, then each warp's ring
  const u32 base = shared_address(shared);
  const u32 scale_base = base;
  const u32 ring = base + groups * 192u + warp * S * slot_bytes;

  // stage the raw (scale, zero) words after each group's converted ones
  const u32* raw = scales + (size_t)tile * groups * 16;
  for (int i = threadIdx.x; i < groups * 4; i += blockDim.x) {
    copy_async16(scale_base + (i >> 2) * 192u + 128u + (i & 3) * 16u, raw + i * 4);
  }

  const char* code_src = reinterpret_cast<const char*>(codes + ((size_t)tile * chunks + warp) * 32 + lane);
  const size_t code_step = (size_t)warps * 512;
  const char* x_src[NB];
  int x_on[NB];
  u32 x_dst[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int row = g + 8 * nb;
    x_on[nb] = row < M;
    x_src[nb] = reinterpret_cast<const char*>(x + (size_t)(x_on[nb] ? row : 0) * ldx + warp * 64 + 16 * t);
    // the lanes of rows the batch does not have read row 0's bytes: their B column only feeds an output
    // column that is not stored (the mma's columns are independent)
    x_dst[nb] = 512u + (x_on[nb] ? row : 0) * 128u + t * 32u;
  }
  const size_t x_step = (size_t)warps * 128;

  commit_copies();   // group: the scales
  // then a group with the codes of the first S - 1 chunks
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    copy_async16_if(ring + i * slot_bytes + lane * 16u, code_src, i < mine);
    code_src += code_step;
  }
  commit_copies();
  // the activations of the first S - 1 chunks (a group per chunk) once the previous kernel is done: the
  // loop's wait for at most S - 2 pending groups then finds chunk j's codes and activations complete
  wait_previous_kernel();
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    const u32 slot = ring + i * slot_bytes;
    const int live = i < mine;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      copy_async16_if(slot + x_dst[nb], x_src[nb], live & x_on[nb]);
      copy_async16_if(slot + x_dst[nb] + 16u, x_src[nb] + 16, live & x_on[nb]);
      x_src[nb] += x_step;
    }
    commit_copies();
  }

  wait_copies<S>();   // the scales (the oldest of S + 1 groups) are complete for this thread ...
  __syncthreads();    // ... and for every thread

  const float magic_f = BF16 ? 128.f : 1024.f;
  // convert: [group][row 0..15] (scale, zero) -> [group][g][(scale g, -(magic + z_g), scale g+8, -(magic + z_g8))]
  // (float16: -(magic / 16 + z_g8) in the last)
  for (int i = threadIdx.x; i < groups * 8; i += blockDim.x) {
    const u32 entry = scale_base + (i >> 3) * 192u;
    const int gg = i & 7;
    u32 w0, w1;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w0), "=r"(w1) : "r"(entry + 128u + gg * 8u) : "memory");
    const u32 out0 = w0 << 16, out2 = w1 << 16;   // the bfloat16 scales' bits as float32
    const u32 out1 = splat2<BF16>(-(as_float(w0 & 0xFFFF0000u) + magic_f));
    // float16: rows g + 8 come out of their nibbles as 1024 + 16 q (no shift, see the loop), scaled by 1 / 16
    const u32 out3 = splat2<BF16>(-(as_float(w1 & 0xFFFF0000u) + (BF16 ? magic_f : magic_f / 16.f)));
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(entry + gg * 16u), "r"(out0), "r"(out1),
                 "r"(out2), "r"(out3)
                 : "memory");
  }
  __syncthreads();

  const u32 magic = BF16 ? 0x43004300u : 0x64006400u;
  const float zero4[4] = {0.f, 0.f, 0.f, 0.f};
  float out[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) out[nb][0] = out[nb][1] = out[nb][2] = out[nb][3] = 0.f;

  u32 read = ring;                             // the slot of this iteration's chunk
  u32 write = ring + (S - 1) * slot_bytes;     // the slot consumed one iteration ago
  const u32 ring_end = ring + S * slot_bytes;
  int cc = warp;
  for (int j = 0; j < mine; ++j, cc += warps) {
    wait_copies<S - 2>();   // pending: at most the S - 2 chunks after this one
    const Words4 w = load_shared16(read + lane * 16u);
    Words4 xa[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      xa[nb][0] = load_shared16(read + x_dst[nb]);
      xa[nb][1] = load_shared16(read + x_dst[nb] + 16u);
    }
    const int live = j + S - 1 < mine;
    copy_async16_if(write + lane * 16u, code_src, live);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      copy_async16_if(write + x_dst[nb], x_src[nb], live & x_on[nb]);
      copy_async16_if(write + x_dst[nb] + 16u, x_src[nb] + 16, live & x_on[nb]);
      x_src[nb] += x_step;
    }
    code_src += code_step;
    commit_copies();
    write = read;
    read += slot_bytes;
    if (read == ring_end) read = ring;

    const Words4 sc = load_shared16(scale_base + (cc >> group_shift) * 192u + g * 16u);
    float acc[NB][4];   // sum x * (q - z) over the chunk
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const u32 v = words[s];
      u32 a[4];
      if (BF16) {
        // 7 mantissa bits hold one nibble per half: each register needs its nibbles at bits 0..3
        a[0] = fma2<BF16>(and_or(v, 0x000F000Fu, magic), 0x3F803F80u, sc.y);
        a[1] = fma2<BF16>(and_or(v >> 4, 0x000F000Fu, magic), 0x3F803F80u, sc.w);
        a[2] = fma2<BF16>(and_or(v >> 8, 0x000F000Fu, magic), 0x3F803F80u, sc.y);
        a[3] = fma2<BF16>(and_or(v >> 12, 0x000F000Fu, magic), 0x3F803F80u, sc.w);
      } else {
        // 10 mantissa bits: nibbles at bits 4..7 of a half are 1024 + 16 q as they lie, times 1 / 16 exactly
        const u32 v8 = v >> 8;
        a[0] = fma2<BF16>(and_or(v, 0x000F000Fu, magic), 0x3C003C00u, sc.y);
        a[1] = fma2<BF16>(and_or(v, 0x00F000F0u, magic), 0x2C002C00u, sc.w);
        a[2] = fma2<BF16>(and_or(v8, 0x000F000Fu, magic), 0x3C003C00u, sc.y);
        a[3] = fma2<BF16>(and_or(v8, 0x00F000F0u, magic), 0x2C002C00u, sc.w);
      }
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const Words4& lo = xa[nb][s >> 1];
        const u32 b0 = (s & 1) ? lo.z : lo.x;
        const u32 b1 = (s & 1) ? lo.w : lo.y;
        mma16816<BF16>(acc[nb], a, b0, b1, s == 0 ? zero4 : acc[nb]);
      }
    }
    const float s_g = as_float(sc.x), s_g8 = as_float(sc.z);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      out[nb][0] = fma_f32(s_g, acc[nb][0], out[nb][0]);
      out[nb][1] = fma_f32(s_g, acc[nb][1], out[nb][1]);
      out[nb][2] = fma_f32(s_g8, acc[nb][2], out[nb][2]);
      out[nb][3] = fma_f32(s_g8, acc[nb][3], out[nb][3]);
    }
  }
  wait_copies<0>();

  if (warps > 1) {
    // each warp's sums go to the start of its own ring (at least 1 KiB), which no other warp writes
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");   // every lane has read its last slot
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        asm volatile("st.shared.f32 [%0], %1;" ::"r"(ring + ((nb * 4 + i) * 32 + lane) * 4u), "f"(out[nb][i])
                     : "memory");
      }
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = 0.f;
        for (int w2 = 0; w2 < warps; ++w2) {
          float v;
          asm volatile("ld.shared.f32 %0, [%1];"
                       : "=f"(v)
                       : "r"(base + groups * 192u + w2 * S * slot_bytes + ((nb * 4 + i) * 32 + lane) * 4u)
                       : "memory");
          sum += v;
        }
        out[nb][i] = sum;
      }
    }
  }
  // C fragment: c0, c1 at (tile row g, batch rows 2t, 2t + 1), c2, c3 at tile row g + 8.
  if (silu) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = 8 * nb + 2 * t + i;
        if (row < M) {
          const float gate = round16<BF16>(out[nb][i]), up = round16<BF16>(out[nb][i + 2]);
          y[(size_t)row * ldy + 8 * tile + g] = to_half<BF16>(silu_mul(gate, up));
        }
      }
    }
    return;
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 8 * nb + 2 * t + (i & 1);
      const int channel = pair_half ? (i >> 1) * pair_half + 8 * tile + g : 16 * tile + g + 8 * (i >> 1);
      if (row < M) y[(size_t)row * ldy + channel] = to_half<BF16>(out[nb][i]);
    }
  }
}
