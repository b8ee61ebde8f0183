// Causal grouped-query attention over the KV cache, following
// tensor.Ops.Attention: q and out are F32 [T, heads*headDim]; k and v are
// caches [maxPos, kvHeads*headDim] in F32, F16, BF16, Q8_0 or Q8_B8 (kvcache.cuh);
// query t sits at position pos0+t and sees positions 0..pos0+t; query head
// h reads KV head h/(heads/kvHeads). Softmax is F32.
//
// The kernels for long caches are in attention_split.cuh (decode) and
// flash_attention.cuh (prefill); this file's is their fallback, for any
// head dimension and device.
//
// attention_<kv>: one block per (head, query). Each warp walks a strided
// subset of the positions with an online softmax (running max, running
// sum, running weighted sum of V); the warps' partial results are merged at
// the end. Lane l holds dimensions l, l+32, ... of q and of the
// accumulator, so a head dimension of up to 32*ATT_PER is supported.
#include "kvcache.cuh"

#define ATT_WARPS 8
#define ATT_PER 8  // head_dim <= 256

template <typename KV>
__device__ void attention(float* out, const float* q, kv_cache<KV> K, kv_cache<KV> V, int heads, int kvHeads, int headDim, int pos0,
			  float scale) {
	const int h = blockIdx.x, t = blockIdx.y;
	const int kvh = h / (heads / kvHeads);
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const long long qStride = (long long)heads * headDim;

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
	const int e0 = kvh * headDim;
	for (int p = warp; p < npos; p += ATT_WARPS) {
		float s = 0.0f;
#pragma unroll
		for (int i = 0; i < ATT_PER; i++) {
			const int d = lane + 32 * i;
			if (d < headDim) s += qr[i] * K.at(p, e0 + d);
		}
		s = warp_sum(s);
		const float mnew = fmaxf(m, s);
		const float corr = expf(m - mnew);  // 0 on the first position (m = -inf)
		const float e = expf(s - mnew);
		l = l * corr + e;
#pragma unroll
		for (int i = 0; i < ATT_PER; i++) {
			const int d = lane + 32 * i;
			if (d < headDim) acc[i] = acc[i] * corr + e * V.at(p, e0 + d);
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

#define ATT_ENTRY(sfx, KV)                                                                                                             \
	extern "C" __global__ void attention_##sfx(float* out, const float* q, const KV* k, const KV* v, int heads, int kvHeads,       \
						   int headDim, int pos0, float scale) {                                              \
		const long long stride = (long long)kvHeads * headDim;                                                         \
		attention<KV>(out, q, kv_cache<KV>{k, stride}, kv_cache<KV>{v, stride}, heads, kvHeads, headDim, pos0, scale); \
	}                                                                                                                      \
	extern "C" __global__ void attention_##sfx##_at(float* out, const float* q, const KV* k, const KV* v, int heads,    \
							int kvHeads, int headDim, int pos0, float scale, const int* posAt) { \
		const long long stride = (long long)kvHeads * headDim;                                                         \
		attention<KV>(out, q, kv_cache<KV>{k, stride}, kv_cache<KV>{v, stride}, heads, kvHeads, headDim,              \
			      min(max(*posAt, 0), pos0), scale);                                                               \
	}
// attention_<kv>_at, for captured graphs (cuda/graph.go, tensor.Attn.PosAt):
// the same with pos0 read from device memory when it runs, clamped to
// [0, pos0].
ATT_ENTRY(f32, float)
ATT_ENTRY(f16, __half)
ATT_ENTRY(bf16, bf16)
ATT_ENTRY(q8_0, q8_0)
ATT_ENTRY(q8_b8, q8_b8)

// kv_append_q8_0 quantizes rows of F32 values into a Q8_0 cache: nblocks
// blocks of 32, one a thread, block i of the run at dst + 34*i.
extern "C" __global__ void kv_append_q8_0(uint8_t* dst, const float* src, long long nblocks) {
	GRID_STRIDE(i, nblocks) { quantize_q8_0_block(dst + 34 * i, src + 32 * i); }
}

// kv_append_q8_b8 quantizes rows of F32 values into a Q8_B8 cache: nblocks
// blocks of 8, one a thread, block i of the run at dst + 10*i.
extern "C" __global__ void kv_append_q8_b8(uint8_t* dst, const float* src, long long nblocks) {
	GRID_STRIDE(i, nblocks) { quantize_q8_b8_block(dst + 10 * i, src + 8 * i); }
}
