// Row and elementwise kernels of strata's CUDA backend: rotary embedding,
// SiLU-times-up, bias add, embedding gather, type casts and argmax (RMSNorm
// and the residual add are in fused.cu, with the decode step's kernels).
// Semantics follow tensor.Ops in tensor/backend.go.
#include "common.cuh"

// Rotates x[T, heads*headDim] in place, pairs (j, j+half), row t at
// position pos0+t; cos and sin are [maxPos, half].
extern "C" __global__ void rope_f32(float* x, const float* cosT, const float* sinT, int T, int heads, int headDim, int pos0) {
	const long long total = (long long)T * heads * (headDim / 2);
	GRID_STRIDE(i, total) rope_pair(x, cosT, sinT, i, heads, headDim, rope_from{pos0});
}

// Rotates x[T, heads*headDim] in place as rope_f32 does, row t at position
// pos[t]: the rows of a batched step, each sequence's at its own positions,
// in one launch.
extern "C" __global__ void rope_rows_f32(float* x, const float* cosT, const float* sinT, int T, int heads, int headDim, const int* pos) {
	const long long total = (long long)T * heads * (headDim / 2);
	GRID_STRIDE(i, total) rope_pair(x, cosT, sinT, i, heads, headDim, rope_rows{pos});
}

extern "C" __global__ void silu_mul_f32(float* out, const float* gate, const float* up, long long n) {
	GRID_STRIDE(i, n) {
		const float g = gate[i];
		out[i] = g / (1.0f + expf(-g)) * up[i];
	}
}

// out[M,N] += bias[N] on every row.
template <typename W>
__device__ void bias_add(float* out, const W* bias, long long M, int N) {
	GRID_STRIDE(i, M * N) out[i] += to_f32(bias[i % N]);
}
extern "C" __global__ void bias_add_f32(float* out, const float* b, long long M, int N) { bias_add(out, b, M, N); }
extern "C" __global__ void bias_add_f16(float* out, const __half* b, long long M, int N) { bias_add(out, b, M, N); }
extern "C" __global__ void bias_add_bf16(float* out, const bf16* b, long long M, int N) { bias_add(out, b, M, N); }

// out[i,:] = table[ids[i],:]; ids were range-checked on the host.
template <typename W>
__device__ void embed(float* out, const W* table, const int* ids, int n, int dim) {
	GRID_STRIDE(i, (long long)n * dim) {
		const long long r = i / dim, c = i % dim;
		out[i] = to_f32(table[(long long)ids[r] * dim + c]);
	}
}
extern "C" __global__ void embed_f32(float* out, const float* t, const int* ids, int n, int dim) { embed(out, t, ids, n, dim); }
extern "C" __global__ void embed_f16(float* out, const __half* t, const int* ids, int n, int dim) { embed(out, t, ids, n, dim); }
extern "C" __global__ void embed_bf16(float* out, const bf16* t, const int* ids, int n, int dim) { embed(out, t, ids, n, dim); }

// out[t,:] = sum over j < k of w[r] * src[r,:], r = idx[t*k+j], in the order
// of j with each product rounded before the add (the bits of scaling the
// rows, then adding them one after another): tensor.CombineRows. idx was
// range-checked on the host.
extern "C" __global__ void combine_rows_f32(float* out, const float* src, const float* w, const int* idx, int n, int dim, int k) {
	GRID_STRIDE(i, (long long)n * dim) {
		const long long t = i / dim, c = i % dim;
		const int* rs = idx + t * k;
		float acc = __fmul_rn(w[rs[0]], src[(long long)rs[0] * dim + c]);
		for (int j = 1; j < k; j++) {
			const int r = rs[j];
			acc = __fadd_rn(acc, __fmul_rn(w[r], src[(long long)r * dim + c]));
		}
		out[i] = acc;
	}
}

extern "C" __global__ void cast_f32_f16(__half* dst, const float* src, long long n) {
	GRID_STRIDE(i, n) dst[i] = __float2half_rn(src[i]);
}
extern "C" __global__ void cast_f32_bf16(bf16* dst, const float* src, long long n) {
	GRID_STRIDE(i, n) dst[i] = bf16_from_f32(src[i]);
}
// hi + lo = src to about 16 significant bits: two BF16 products with F32
// accumulation keep F32-like precision for BF16 weights.
extern "C" __global__ void split_f32_bf16(bf16* hi, bf16* lo, const float* src, long long n) {
	GRID_STRIDE(i, n) {
		bf16 h = bf16_from_f32(src[i]);
		hi[i] = h;
		lo[i] = bf16_from_f32(src[i] - to_f32(h));
	}
}
extern "C" __global__ void cast_f16_f32(float* dst, const __half* src, long long n) {
	GRID_STRIDE(i, n) dst[i] = __half2float(src[i]);
}
extern "C" __global__ void cast_bf16_f32(float* dst, const bf16* src, long long n) {
	GRID_STRIDE(i, n) dst[i] = to_f32(src[i]);
}

// out[r] = the index of the largest element of x[r,:], the lowest index on
// ties, or -1 when the row holds a NaN or an infinity (greedy decoding's
// logits, which are then an error). One block per row.
extern "C" __global__ void argmax_f32(int* out, const float* x, int n) {
	const float* xr = x + (long long)blockIdx.x * n;
	float best = -INFINITY;
	int idx = 0x7fffffff;
	int bad = 0;
	for (int i = threadIdx.x; i < n; i += blockDim.x) {
		const float v = xr[i];
		bad |= !isfinite(v);
		if (v > best || (v == best && i < idx)) {
			best = v;
			idx = i;
		}
	}
	__shared__ float sv[1024];
	__shared__ int si[1024];
	sv[threadIdx.x] = best;
	si[threadIdx.x] = idx;
	bad = __syncthreads_or(bad);
	for (int s = blockDim.x / 2; s > 0; s >>= 1) {
		if (threadIdx.x < s) {
			const float v = sv[threadIdx.x + s];
			const int j = si[threadIdx.x + s];
			if (v > sv[threadIdx.x] || (v == sv[threadIdx.x] && j < si[threadIdx.x])) {
				sv[threadIdx.x] = v;
				si[threadIdx.x] = j;
			}
		}
		__syncthreads();
	}
	if (threadIdx.x == 0) out[blockIdx.x] = bad ? -1 : si[0];
}
