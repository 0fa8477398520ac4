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
// Nibbles p and p + 4 become the two halves of A register p % 4 ... (p = 0..3) with one lop3 each, and
// the features of one lane are 16 consecutive activations (two 16-byte loads per chunk), read as the
// B registers of the four steps. The mma's k order is a permutation of the features, the same on
// both operands, so the dot products are unchanged.
//
// Scales: 32-bit words [N/16][groups][16]: the low half is the scale, the high half -zero * scale,
// both in the activation dtype. A code q becomes w = q * s + (-z * s) in two packed FMAs:
// (magic + q) * 1 - magic (exact), then * s + m (one rounding, like a dequantized 16-bit weight).

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

// both halves set to the low (sel 0x1010) or high (0x3232) half of a
__device__ __forceinline__ u32 dup_half(u32 a, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(a), "r"(sel));
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

template <bool BF16>
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  if (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// Two codes (nibbles at bits 0-3 and 16-19 of v) as 16-bit weights q * s + m.
template <bool BF16>
__device__ __forceinline__ u32 dequant2(u32 v, u32 s2, u32 m2) {
  const u32 magic = BF16 ? 0x43004300u : 0x64006400u;       // 128 (bf16) / 1024 (fp16): magic + q exact
  const u32 one = BF16 ? 0x3F803F80u : 0x3C003C00u;
  const u32 neg_magic = BF16 ? 0xC300C300u : 0xE400E400u;
  u32 q = fma2<BF16>(and_or(v, 0x000F000Fu, magic), one, neg_magic);
  return fma2<BF16>(q, s2, m2);
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

// One ring slot, in 16-byte words: a chunk's codes (32 lanes x 1), each lane's two scale words (rows g and
// g + 8; 32 x 8 bytes), then the chunk's activations, 128 bytes per batch row (lane 4 g + t holds features
// 16 t .. 16 t + 15 of row g, and of row g + 8 when NB = 2); a slot has as many rows as the batch.
constexpr int kCodeWords4 = 32;
constexpr int kScaleWords4 = 16;

struct Stream {
  const Words4* codes;   // this lane's 16 bytes of chunk 0 of the tile
  const u32* scales;     // row g's scale word of group 0 of the tile
  const Words4* x[2];    // this lane's 32 bytes of chunk 0 of batch rows g and g + 8
  bool has_x[2];
  int chunks_per_group;
};

// Copy chunk cc of the stream into a slot (every lane its own bytes).
template <int NB>
__device__ __forceinline__ void fetch(Words4* slot, const Stream& st, int cc, int lane) {
  copy_async16(slot + lane, st.codes + (size_t)cc * 32);
  const int gi = cc / st.chunks_per_group;
  u32* sdst = reinterpret_cast<u32*>(slot + kCodeWords4) + 2 * lane;
  copy_async4(sdst, st.scales + gi * 16);
  copy_async4(sdst + 1, st.scales + gi * 16 + 8);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (st.has_x[nb]) {
      Words4* xdst = slot + kCodeWords4 + kScaleWords4 + (nb * 32 + lane) * 2;
      copy_async16(xdst, st.x[nb] + cc * 8);
      copy_async16(xdst + 1, st.x[nb] + cc * 8 + 1);
    }
  }
}

// grid (N / 16), block (32 * warps), dynamic shared memory warps * S * (768 + 128 * M) bytes.
// The warps of a block share the K chunks of one 16-channel tile, in turn (chunk warp + warps * j, so that
// a block reads one contiguous stretch of the tile at a time). Each warp streams its chunks, with their
// scales and activations, through its own ring of S shared-memory slots with cp.async, S - 1 chunks in
// flight; every lane copies and reads only its own bytes, so no barrier is needed until the warps add
// their sums at the end. Even and odd mma steps accumulate separately (two dependency chains).
template <bool BF16, int NB, int S>
__global__ void __launch_bounds__(512) w4a16_mma_decode(
    const Words4* __restrict__ codes, const u32* __restrict__ scales, const u16* __restrict__ x,
    u16* __restrict__ y, int M, int K, int ldx, int ldy, int chunks_per_group, int groups) {
  const int slot_words = kCodeWords4 + kScaleWords4 + 8 * min(M, 8 * NB);   // only the batch rows there are
  extern __shared__ __align__(16) unsigned char shared[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int tile = blockIdx.x;
  const int chunks = K >> 6;
  const int mine = chunks > warp ? (chunks - warp + warps - 1) / warps : 0;

  Words4* ring = reinterpret_cast<Words4*>(shared) + warp * S * slot_words;
  Stream st;
  st.codes = codes + (size_t)tile * chunks * 32 + lane;
  st.scales = scales + (size_t)tile * groups * 16 + g;
  st.chunks_per_group = chunks_per_group;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    const int row = g + 8 * nb;
    st.has_x[nb] = nb < NB && row < M;
    st.x[nb] = reinterpret_cast<const Words4*>(x + (size_t)(st.has_x[nb] ? row : 0) * ldx) + 2 * t;
  }
  float acc[2][NB][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      acc[h][nb][0] = acc[h][nb][1] = acc[h][nb][2] = acc[h][nb][3] = 0.f;
    }
  }

#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < mine) fetch<NB>(ring + i * slot_words, st, warp + warps * i, lane);
    commit_copies();
  }

  int read = 0;        // the slot of this iteration's chunk
  int write = S - 1;   // the slot consumed one iteration ago
  for (int j = 0; j < mine; ++j) {
    wait_copies<S - 2>();   // S - 1 + j groups committed: this chunk's is complete
    const Words4* slot = ring + read * slot_words;
    const Words4 w = slot[lane];
    const u32 s_lo = reinterpret_cast<const u32*>(slot + kCodeWords4)[2 * lane];
    const u32 s_hi = reinterpret_cast<const u32*>(slot + kCodeWords4)[2 * lane + 1];
    Words4 xa[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const Words4* xs = slot + kCodeWords4 + kScaleWords4 + (nb * 32 + lane) * 2;
      xa[nb][0] = st.has_x[nb] ? xs[0] : Words4{0u, 0u, 0u, 0u};
      xa[nb][1] = st.has_x[nb] ? xs[1] : Words4{0u, 0u, 0u, 0u};
    }
    if (j + S - 1 < mine) fetch<NB>(ring + write * slot_words, st, warp + warps * (j + S - 1), lane);
    commit_copies();
    write = read;
    read = read + 1 == S ? 0 : read + 1;

    const u32 s_g = dup_half(s_lo, 0x1010u), m_g = dup_half(s_lo, 0x3232u);
    const u32 s_g8 = dup_half(s_hi, 0x1010u), m_g8 = dup_half(s_hi, 0x3232u);
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const u32 v = words[s];
      u32 a[4];
      a[0] = dequant2<BF16>(v, s_g, m_g);
      a[1] = dequant2<BF16>(v >> 4, s_g8, m_g8);
      a[2] = dequant2<BF16>(v >> 8, s_g, m_g);
      a[3] = dequant2<BF16>(v >> 12, s_g8, m_g8);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const Words4& lo = xa[nb][s >> 1];
        const u32 b0 = (s & 1) ? lo.z : lo.x;
        const u32 b1 = (s & 1) ? lo.w : lo.y;
        mma16816<BF16>(acc[s & 1][nb], a, b0, b1);
      }
    }
  }
  wait_copies<0>();
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[0][nb][i] += acc[1][nb][i];
  }

  if (warps > 1) {
    // each warp's sums go to the start of its own ring, which no other warp writes
    float* own = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) own[(nb * 4 + i) * 32 + lane] = acc[0][nb][i];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = 0.f;
        for (int w2 = 0; w2 < warps; ++w2) {
          sum += reinterpret_cast<const float*>(reinterpret_cast<Words4*>(shared) + w2 * S * slot_words)
              [(nb * 4 + i) * 32 + lane];
        }
        acc[0][nb][i] = sum;
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
      if (row < M) y[(size_t)row * ldy + channel] = to_half<BF16>(acc[0][nb][i]);
    }
  }
}
