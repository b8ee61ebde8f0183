// The row kernels of a decode step (tensor.RMSNorm, tensor.AddRMSNorm,
// tensor.RopeKV, the residual add) and the rotary embedding with its
// position read from device memory, for captured graphs
// (tensor.Rotary.PosAt). A position read from memory is clamped to
// [0, bound], the host's upper bound of it, so that a wrong value cannot
// reach outside the tables and caches. step_pdl.cu compiles this file
// again as the kernels' programmatic-dependent-launch twins (step.cuh).
#include "kvcache.cuh"
#include "norm.cuh"
#include "step.cuh"

__device__ __forceinline__ int position(int bound, const int* at) {
	if (at == nullptr) return bound;
	return min(max(*at, 0), bound);
}

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(bf16* p, float v) { *p = bf16_from_f32(v); }

// out[r,:] = x[r,:] / sqrt(mean(x[r,:]^2) + eps) * w. One block per row. A
// row of at most 4*NORM_VEC*blockDim.x elements, aligned for load4, is
// read once, as float4, each thread's loads all in flight before the sum
// (a decode step's row is one dependent round of loads, where a loop of
// single floats took several); other rows take the loop.
template <typename W>
__device__ void rmsnorm(float* out, const float* x, const W* w, int n, float eps) {
	const long long row = blockIdx.x;
	const float* xr = x + row * n;
	float* orow = out + row * n;
	float s = 0.0f;
	if (n <= 4 * NORM_VEC * (int)blockDim.x && aligned4(xr, w, n) && ((uintptr_t)orow & 15) == 0) {
		const int n4 = n >> 2;
		float4 v[NORM_VEC], wv[NORM_VEC];
#pragma unroll
		for (int u = 0; u < NORM_VEC; u++) {
			const int i = threadIdx.x + u * blockDim.x;
			if (i < n4) {
				v[u] = ((const float4*)xr)[i];
				wv[u] = load4(w, i);
			}
		}
#pragma unroll
		for (int u = 0; u < NORM_VEC; u++)
			if (threadIdx.x + u * blockDim.x < n4) s += sumsq4(v[u]);
		norm_rows4(orow, v, wv, s, n, n4, eps);
		return;
	}
	for (int i = threadIdx.x; i < n; i += blockDim.x) {
		const float v = xr[i];
		s += v * v;
	}
	s = block_sum(s);
	const float r = rsqrtf(s / (float)n + eps);
	for (int i = threadIdx.x; i < n; i += blockDim.x) orow[i] = xr[i] * r * to_f32(w[i]);
}

extern "C" __global__ void STEP_KERNEL(rmsnorm_f32)(float* out, const float* x, const float* w, int n, float eps) {
	step_begin();
	rmsnorm(out, x, w, n, eps);
}
extern "C" __global__ void STEP_KERNEL(rmsnorm_f16)(float* out, const float* x, const __half* w, int n, float eps) {
	step_begin();
	rmsnorm(out, x, w, n, eps);
}
extern "C" __global__ void STEP_KERNEL(rmsnorm_bf16)(float* out, const float* x, const bf16* w, int n, float eps) {
	step_begin();
	rmsnorm(out, x, w, n, eps);
}

// x[r,:] += d[r,:], then out[r,:] = x[r,:] / sqrt(mean(x[r,:]^2) + eps) * w.
// One block per row; each thread reads back only what it wrote. Rows that
// fit NORM_VEC float4 a thread are read once and held, as rmsnorm's.
template <typename W>
__device__ void add_rmsnorm(float* out, float* x, const float* d, const W* w, int n, float eps) {
	const long long row = blockIdx.x;
	float* xr = x + row * n;
	const float* dr = d + row * n;
	float* orow = out + row * n;
	float s = 0.0f;
	if (n <= 4 * NORM_VEC * (int)blockDim.x && aligned4(xr, w, n) && (((uintptr_t)dr | (uintptr_t)orow) & 15) == 0) {
		const int n4 = n >> 2;
		float4 v[NORM_VEC], dv[NORM_VEC], wv[NORM_VEC];
#pragma unroll
		for (int u = 0; u < NORM_VEC; u++) {
			const int i = threadIdx.x + u * blockDim.x;
			if (i < n4) {
				v[u] = ((const float4*)xr)[i];
				dv[u] = ((const float4*)dr)[i];
				wv[u] = load4(w, i);
			}
		}
#pragma unroll
		for (int u = 0; u < NORM_VEC; u++) {
			const int i = threadIdx.x + u * blockDim.x;
			if (i < n4) {
				v[u] = make_float4(v[u].x + dv[u].x, v[u].y + dv[u].y, v[u].z + dv[u].z, v[u].w + dv[u].w);
				((float4*)xr)[i] = v[u];
				s += sumsq4(v[u]);
			}
		}
		norm_rows4(orow, v, wv, s, n, n4, eps);
		return;
	}
	for (int i = threadIdx.x; i < n; i += blockDim.x) {
		const float v = xr[i] + dr[i];
		xr[i] = v;
		s += v * v;
	}
	s = block_sum(s);
	const float r = rsqrtf(s / (float)n + eps);
	for (int i = threadIdx.x; i < n; i += blockDim.x) orow[i] = xr[i] * r * to_f32(w[i]);
}

extern "C" __global__ void STEP_KERNEL(add_rmsnorm_f32)(float* out, float* x, const float* d, const float* w, int n, float eps) {
	step_begin();
	add_rmsnorm(out, x, d, w, n, eps);
}
extern "C" __global__ void STEP_KERNEL(add_rmsnorm_f16)(float* out, float* x, const float* d, const __half* w, int n, float eps) {
	step_begin();
	add_rmsnorm(out, x, d, w, n, eps);
}
extern "C" __global__ void STEP_KERNEL(add_rmsnorm_bf16)(float* out, float* x, const float* d, const bf16* w, int n, float eps) {
	step_begin();
	add_rmsnorm(out, x, d, w, n, eps);
}

// Rotates x[T, heads*headDim] in place as rope_f32 does, row t at position
// p+t with p read from posAt (clamped to [0, pos0]).
extern "C" __global__ void STEP_KERNEL(rope_f32_at)(float* x, const float* cosT, const float* sinT, int T, int heads, int headDim,
						    int pos0, const int* posAt) {
	step_begin();
	const int p0 = position(pos0, posAt);
	const long long total = (long long)T * heads * (headDim / 2);
	GRID_STRIDE(i, total) rope_pair(x, cosT, sinT, i, heads, headDim, rope_from{p0});
}

// q[T, heads*headDim] rotated in place; k[T, kvHeads*headDim] rotated into
// rows p..p+T-1 of the key cache kc, v copied into the same rows of vc
// (caches of type C), p = pos0 or the value at posAt clamped to [0, pos0].
// One grid-stride pass over the three parts.
template <typename C>
__device__ void rope_kv(float* q, const float* k, const float* v, C* kc, C* vc, const float* cosT, const float* sinT, int T, int heads,
			int kvHeads, int headDim, int pos0, const int* posAt) {
	const int p0 = position(pos0, posAt);
	const int half = headDim / 2;
	const long long kvDim = (long long)kvHeads * headDim;
	const long long nq = (long long)T * heads * half, nk = (long long)T * kvHeads * half, nv = T * kvDim;
	GRID_STRIDE(i, nq + nk + nv) {
		if (i < nq + nk) {
			const bool isQ = i < nq;
			const long long ii = isQ ? i : i - nq;
			const int hs = isQ ? heads : kvHeads;
			const int j = (int)(ii % half);
			const long long th = ii / half;
			const long long t = th / hs;
			const long long ci = (p0 + t) * half + j;
			const float c = cosT[ci], s = sinT[ci];
			const float* src = (isQ ? q : k) + th * headDim;
			const float x1 = src[j], x2 = src[j + half];
			const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
			if (isQ) {
				float* dst = q + th * headDim;
				dst[j] = y1;
				dst[j + half] = y2;
			} else {
				C* dst = kc + (p0 + t) * kvDim + (th % hs) * headDim;
				store(dst + j, y1);
				store(dst + j + half, y2);
			}
		} else {
			const long long e = i - nq - nk;
			const long long t = e / kvDim;
			store(vc + (p0 + t) * kvDim + e % kvDim, v[e]);
		}
	}
}

#define ROPE_KV(C, SFX)                                                                                                           \
	extern "C" __global__ void STEP_KERNEL(rope_kv_##SFX)(float* q, const float* k, const float* v, C* kc, C* vc,                 \
							      const float* cosT, const float* sinT, int T, int heads, int kvHeads, \
							      int headDim, int pos0, const int* posAt) {                           \
		step_begin();                                                                                                     \
		rope_kv(q, k, v, kc, vc, cosT, sinT, T, heads, kvHeads, headDim, pos0, posAt);                                       \
	}
ROPE_KV(float, f32)
ROPE_KV(__half, f16)
ROPE_KV(bf16, bf16)

// rope_kv into Q8_0 and Q8_B8 caches (kvcache.cuh's rope_kv_q8), launched
// in blocks of a multiple of 32 threads.
#define ROPE_KV_Q8(BS, SFX)                                                                                                        \
	extern "C" __global__ void STEP_KERNEL(rope_kv_##SFX)(float* q, const float* k, const float* v, uint8_t* kc, uint8_t* vc,   \
							      const float* cosT, const float* sinT, int T, int heads, int kvHeads, \
							      int headDim, int pos0, const int* posAt) {                           \
		step_begin();                                                                                                     \
		rope_kv_q8<BS>(q, k, v, kc, vc, cosT, sinT, T, heads, kvHeads, headDim, position(pos0, posAt));                     \
	}
ROPE_KV_Q8(32, q8_0)
ROPE_KV_Q8(8, q8_b8)

// out = a + b, elementwise (the residual add).
extern "C" __global__ void STEP_KERNEL(add_f32)(float* out, const float* a, const float* b, long long n) {
	step_begin();
	GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}
