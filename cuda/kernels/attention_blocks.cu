// Causal grouped-query attention over a paged KV cache, following
// tensor.Kernels.AttentionBlocks: the rows of several sequences, q and out
// F32 [T, heads*headDim], their keys and values k and v F32
// [T, kvHeads*headDim], and the pools kp and vp F32
// [blocks*blockSize, kvHeads*headDim] that the sequences' block tables
// index.
//
// The host flattens the sequences into meta (int32):
//   meta[0..T)        each row's pool row (the slot its key and value go to)
//   meta[T..2T)       each row's position: row t sees positions 0..pos
//   meta[2T..3T)      the offset in meta of the row's sequence's block table
//   meta[3T..)        the block tables, one after another
//
// kv_write_blocks copies the rows' keys and values into their slots (a
// grid-stride loop over the elements); attention_blocks then runs one block per (head,
// row), as attention.cu does over a contiguous cache, reading position p
// of the row's sequence at pool row table[p/blockSize]*blockSize +
// p%blockSize.
#include "common.cuh"

#define ATB_WARPS 8
#define ATB_PER 8  // head_dim <= 256

extern "C" __global__ void kv_write_blocks_f32(float* kp, float* vp, const float* k, const float* v, const int* meta, int T, int kvWidth) {
	const long long n = (long long)T * kvWidth;
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
		const int t = (int)(i / kvWidth), d = (int)(i % kvWidth);
		const long long dst = (long long)meta[t] * kvWidth + d;
		kp[dst] = k[i];
		vp[dst] = v[i];
	}
}

extern "C" __global__ void attention_blocks_f32(float* out, const float* q, const float* kp, const float* vp, const int* meta, int T,
						int heads, int kvHeads, int headDim, int blockSize, float scale) {
	const int h = blockIdx.x, t = blockIdx.y;
	const int kvh = h / (heads / kvHeads);
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const long long qStride = (long long)heads * headDim, kvStride = (long long)kvHeads * headDim;
	const int* table = meta + meta[2 * T + t];

	float qr[ATB_PER], acc[ATB_PER];
	const float* qrow = q + t * qStride + (long long)h * headDim;
#pragma unroll
	for (int i = 0; i < ATB_PER; i++) {
		const int d = lane + 32 * i;
		qr[i] = d < headDim ? qrow[d] * scale : 0.0f;
		acc[i] = 0.0f;
	}
	float m = -INFINITY, l = 0.0f;
	const int npos = meta[T + t] + 1;
	const float* kb = kp + (long long)kvh * headDim;
	const float* vb = vp + (long long)kvh * headDim;
	for (int p = warp; p < npos; p += ATB_WARPS) {
		const long long row = (long long)table[p / blockSize] * blockSize + p % blockSize;
		const float* kr = kb + row * kvStride;
		float s = 0.0f;
#pragma unroll
		for (int i = 0; i < ATB_PER; i++) {
			const int d = lane + 32 * i;
			if (d < headDim) s += qr[i] * kr[d];
		}
		s = warp_sum(s);
		const float mnew = fmaxf(m, s);
		const float corr = expf(m - mnew);  // 0 on the first position (m = -inf)
		const float e = expf(s - mnew);
		l = l * corr + e;
		const float* vr = vb + row * kvStride;
#pragma unroll
		for (int i = 0; i < ATB_PER; i++) {
			const int d = lane + 32 * i;
			if (d < headDim) acc[i] = acc[i] * corr + e * vr[d];
		}
		m = mnew;
	}

	__shared__ float sm[ATB_WARPS], sl[ATB_WARPS];
	__shared__ float sacc[ATB_WARPS][32 * ATB_PER];
	if (lane == 0) {
		sm[warp] = m;
		sl[warp] = l;
	}
#pragma unroll
	for (int i = 0; i < ATB_PER; i++) {
		const int d = lane + 32 * i;
		if (d < headDim) sacc[warp][d] = acc[i];
	}
	__syncthreads();
	float M = -INFINITY;
	for (int w = 0; w < ATB_WARPS; w++) M = fmaxf(M, sm[w]);
	float* orow = out + t * qStride + (long long)h * headDim;
	for (int d = threadIdx.x; d < headDim; d += blockDim.x) {
		float num = 0.0f, den = 0.0f;
		for (int w = 0; w < ATB_WARPS; w++) {
			if (sm[w] == -INFINITY) continue;  // this warp saw no position
			const float f = expf(sm[w] - M);
			num += sacc[w][d] * f;
			den += sl[w] * f;
		}
		orow[d] = num / den;
	}
}
