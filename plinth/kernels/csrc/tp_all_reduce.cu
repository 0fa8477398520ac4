// One-shot all-reduce of bfloat16 rows over peer memory for tensor parallelism on one host, optionally
// fused with the residual add and RMSNorm that follow it in a decoder layer.
//
// Compiled at run time with NVRTC (plinth/distributed/custom_all_reduce.py); no CUDA headers.
//
// Every rank owns one buffer that all ranks of the group map (torch's symmetric memory):
//     [0, FLAG_BYTES)                         flags: u32 [MAX_BLOCKS][8], flags[b][r] = the last call in
//                                             which block b of rank r wrote its rows here
//     [FLAG_BYTES + s * slot_bytes, ...)      data slot s (s = call parity): this rank's partial rows
// A call: block b copies its rows (rows b, b + gridDim.x, ...) of this rank's input into this rank's slot,
// tells every peer's block b so (a release store of the call number into the peer's flags[b][rank]),
// waits until every peer's block b has told it the same, then reads the rows from every rank's slot and
// adds them in rank order (float32; every rank gets the same bits). Blocks only wait for their own rows,
// never for the whole grid. The grid is the same for every call of one buffer, so the per-block call
// counters (`calls`, in this rank's ordinary memory) agree across blocks and ranks.
// Two slots: a peer may still be reading call n's rows when this rank starts call n + 1, but not call
// n - 1's (it signalled call n only after its call n - 1 had finished), so call n + 1 writes the other slot.
// A wait gives up after wait_ns with a trap (a dead peer must not hang the process: the trap fails the
// step with a CUDA error).
//
// FUSED: out = RMSNorm(sum + residual) * weight and residual = sum + residual, with the roundings of the
// unfused path (the sum rounded to bfloat16, then the residual add rounded, then the norm in float32).

typedef unsigned int u32;
typedef unsigned long long u64;

#define FLAG_BYTES 4096
#define MAX_RANKS 8

struct __align__(16) Vec {
  u32 v[4];   // eight bfloat16 values
};

__device__ __forceinline__ float lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// bfloat16(a) in the high half, bfloat16(b) in the low half, round to nearest even
__device__ __forceinline__ u32 pack(float a, float b) {
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ void store_release(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 load_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ Vec load_volatile(const Vec* p) {
  Vec r;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3])
               : "l"(p)
               : "memory");
  return r;
}

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <bool FUSED>
__global__ void __launch_bounds__(1024)
tp_all_reduce(const u64* __restrict__ buffers,   // [world] every rank's buffer, mapped here
              u32* __restrict__ calls,           // [gridDim.x] this rank's call counter per block
              int rank, int world,
              const Vec* x,                      // [rows][units] this rank's partial sums
              Vec* out,                          // [rows][units] the sum, or (FUSED) the normed sum
              Vec* residual,                     // FUSED: [rows][units] read, then overwritten with sum + residual
              const Vec* __restrict__ weight,    // FUSED: [units] the norm's weight
              int rows, int units,               // units: eight values each (a row is 8 * units values)
              float eps, u64 slot_bytes, u64 wait_ns) {
  const int tid = threadIdx.x;
  const u32 call = calls[blockIdx.x] + 1;
  const u64 slot_offset = FLAG_BYTES + (call & 1) * slot_bytes;
  Vec* mine = reinterpret_cast<Vec*>(buffers[rank] + slot_offset);

  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    if (tid < units) mine[row * units + tid] = x[row * units + tid];
  }
  __syncthreads();   // this block's rows are written: the release below covers them
  if (tid < world && tid != rank) {
    u32* theirs = reinterpret_cast<u32*>(buffers[tid]) + blockIdx.x * MAX_RANKS + rank;
    store_release(theirs, call);
    const u32* flag = reinterpret_cast<const u32*>(buffers[rank]) + blockIdx.x * MAX_RANKS + tid;
    const u64 start = now_ns();
    while ((int)(load_acquire(flag) - call) < 0) {   // a later call number also means this one was written
      if (now_ns() - start > wait_ns) asm volatile("trap;");
    }
  }
  __syncthreads();

  __shared__ float partial[32];
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const bool active = tid < units;
    const int at = row * units + tid;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    if (active) {
      for (int r = 0; r < world; ++r) {
        const Vec v = load_volatile(reinterpret_cast<const Vec*>(buffers[r] + slot_offset) + at);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] += lo(v.v[i]);
          acc[2 * i + 1] += hi(v.v[i]);
        }
      }
    }
    Vec s;
#pragma unroll
    for (int i = 0; i < 4; ++i) s.v[i] = pack(acc[2 * i + 1], acc[2 * i]);
    if (!FUSED) {
      if (active) out[at] = s;
      continue;
    }
    float h[8];
    float sq = 0.f;
    if (active) {
      const Vec res = residual[at];
      Vec hv;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        hv.v[i] = pack(hi(s.v[i]) + hi(res.v[i]), lo(s.v[i]) + lo(res.v[i]));
        h[2 * i] = lo(hv.v[i]);
        h[2 * i + 1] = hi(hv.v[i]);
      }
      residual[at] = hv;
#pragma unroll
      for (int i = 0; i < 8; ++i) sq += h[i] * h[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if ((tid & 31) == 0) partial[tid >> 5] = sq;
    __syncthreads();
    if (tid < 32) {
      float p = tid < (int)(blockDim.x >> 5) ? partial[tid] : 0.f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
      if (tid == 0) partial[0] = p;
    }
    __syncthreads();
    const float inv = rsqrtf(partial[0] / (float)(units * 8) + eps);
    __syncthreads();   // partial[0] is read before the next row overwrites it
    if (active) {
      const Vec w = weight[tid];
      Vec y;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 normed = pack(h[2 * i + 1] * inv, h[2 * i] * inv);   // rounded, as the unfused kernel
        y.v[i] = pack(hi(normed) * hi(w.v[i]), lo(normed) * lo(w.v[i]));
      }
      out[at] = y;
    }
  }
  if (tid == 0) calls[blockIdx.x] = call;
}
