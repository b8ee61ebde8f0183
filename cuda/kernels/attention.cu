// Causal grouped-query attention over the KV cache, for prefill (T > 1) and
// decode (T == 1), following tensor.Ops.Attention: q and out are F32
// [T, heads*headDim]; k and v are caches [maxPos, kvHeads*headDim] in F32,
// F16 or BF16; query t sits at position pos0+t and sees positions
// 0..pos0+t; query head h reads KV head h/(heads/kvHeads). Softmax is F32.
//
// One block per (head, query). Each warp walks a strided subset of the
// positions with an online softmax (running max, running sum, running
// weighted sum of V); the warps' partial results are merged at the end.
// Lane l holds dimensions l, l+32, ... of q and of the accumulator, so a
// head dimension of up to 32*ATT_PER is supported.
#include "common.cuh"

#define ATT_WARPS 8
#define ATT_PER 8  // head_dim <= 256

template <typename KV>
__device__ void attention(float* out, const float* q, const KV* k, const KV* v, int heads, int kvHeads, int headDim, int pos0,
			  float scale) {
	const int h = blockIdx.x, t = blockIdx.y;
	const int kvh = h / (heads / kvHeads);
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const long long qStride = (long long)heads * headDim, kvStride = (long long)kvHeads * headDim;

	float qr[ATT_PER], acc[ATT_PER];
	const float* qrow = q + t * qStride + (long long)h * headDim;
#pragma unroll
	for (int i = 0; i < ATT_PER; i++) {
		const int d = lane + 32 * i;
		qr[i] = d < headDim ? qrow[d] * scale : 0.0f;
		acc[i] = 0.0f;
	}
	float m = -INFINITY, l = 0.0f;
	const int npos = pos0 + t + 1;
	const KV* kb = k + (long long)kvh * headDim;
	const KV* vb = v + (long long)kvh * headDim;
	for (int p = warp; p < npos; p += ATT_WARPS) {
		const KV* kr = kb + p * kvStride;
		float s = 0.0f;
#pragma unroll
		for (int i = 0; i < ATT_PER; i++) {
			const int d = lane + 32 * i;
			if (d < headDim) s += qr[i] * to_f32(kr[d]);
		}
		s = warp_sum(s);
		const float mnew = fmaxf(m, s);
		const float corr = expf(m - mnew);  // 0 on the first position (m = -inf)
		const float e = expf(s - mnew);
		l = l * corr + e;
		const KV* vr = vb + p * kvStride;
#pragma unroll
		for (int i = 0; i < ATT_PER; i++) {
			const int d = lane + 32 * i;
			if (d < headDim) acc[i] = acc[i] * corr + e * to_f32(vr[d]);
		}
		m = mnew;
	}

	__shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
	__shared__ float sacc[ATT_WARPS][32 * ATT_PER];
	if (lane == 0) {
		sm[warp] = m;
		sl[warp] = l;
	}
#pragma unroll
	for (int i = 0; i < ATT_PER; i++) {
		const int d = lane + 32 * i;
		if (d < headDim) sacc[warp][d] = acc[i];
	}
	__syncthreads();
	float M = -INFINITY;
	for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm[w]);
	float* orow = out + t * qStride + (long long)h * headDim;
	for (int d = threadIdx.x; d < headDim; d += blockDim.x) {
		float num = 0.0f, den = 0.0f;
		for (int w = 0; w < ATT_WARPS; w++) {
			if (sm[w] == -INFINITY) continue;  // this warp saw no position
			const float f = expf(sm[w] - M);
			num += sacc[w][d] * f;
			den += sl[w] * f;
		}
		orow[d] = num / den;
	}
}

extern "C" __global__ void attention_f32(float* out, const float* q, const float* k, const float* v, int heads, int kvHeads, int headDim,
					 int pos0, float scale) {
	attention(out, q, k, v, heads, kvHeads, headDim, pos0, scale);
}
extern "C" __global__ void attention_f16(float* out, const float* q, const __half* k, const __half* v, int heads, int kvHeads, int headDim,
					 int pos0, float scale) {
	attention(out, q, k, v, heads, kvHeads, headDim, pos0, scale);
}
extern "C" __global__ void attention_bf16(float* out, const float* q, const bf16* k, const bf16* v, int heads, int kvHeads, int headDim,
					  int pos0, float scale) {
	attention(out, q, k, v, heads, kvHeads, headDim, pos0, scale);
}

// For captured graphs (cuda/graph.go, tensor.Attn.PosAt): the kernels above
// with pos0 read from device memory when they run, clamped to [0, pos0].
// Only the entry points are added here; the body is the one above.
extern "C" __global__ void attention_f32_at(float* out, const float* q, const float* k, const float* v, int heads, int kvHeads,
					    int headDim, int pos0, float scale, const int* posAt) {
	attention(out, q, k, v, heads, kvHeads, headDim, min(max(*posAt, 0), pos0), scale);
}
extern "C" __global__ void attention_f16_at(float* out, const float* q, const __half* k, const __half* v, int heads, int kvHeads,
					    int headDim, int pos0, float scale, const int* posAt) {
	attention(out, q, k, v, heads, kvHeads, headDim, min(max(*posAt, 0), pos0), scale);
}
extern "C" __global__ void attention_bf16_at(float* out, const float* q, const bf16* k, const bf16* v, int heads, int kvHeads,
					     int headDim, int pos0, float scale, const int* posAt) {
	attention(out, q, k, v, heads, kvHeads, headDim, min(max(*posAt, 0), pos0), scale);
}
