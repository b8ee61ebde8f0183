// Causal grouped-query attention over a paged KV cache, following
// tensor.Kernels.AttentionBlocks: the rows of several sequences, q and out
// F32 [T, heads*headDim], their keys and values k and v F32
// [T, kvHeads*headDim], and the pools kp and vp [blocks*blockSize,
// kvHeads*headDim] that the sequences' block tables index, in a cache
// dtype (kvcache.cuh: F32, F16, BF16, Q8_0, Q8_B8).
//
// The host flattens the sequences into meta (int32):
//   meta[0..T)        each row's pool row (the slot its key and value go to)
//   meta[T..2T)       each row's position: row t sees positions 0..pos
//   meta[2T..3T)      the offset in meta of the row's sequence's block table
//   meta[3T..)        the block tables, one after another
//
// kv_write_blocks_<kv> copies the rows' keys and values into their slots,
// converted as a cache append converts them (a grid-stride loop over the
// elements, or over the blocks of the 8-bit caches); attention_blocks_<kv>
// then runs one block per (head, row), as attention.cu does over a
// contiguous cache, reading position p of the row's sequence at pool row
// table[p/blockSize]*blockSize + p%blockSize.
#include "kvcache.cuh"

#define ATB_WARPS 8
#define ATB_PER 8  // head_dim <= 256

__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kv_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void kv_store(bf16* p, float x) { *p = bf16_from_f32(x); }

template <typename KV>
__device__ void kv_write_blocks(KV* kp, KV* vp, const float* k, const float* v, const int* meta, int T, int kvWidth) {
	const long long n = (long long)T * kvWidth;
	GRID_STRIDE(i, n) {
		const int t = (int)(i / kvWidth), d = (int)(i % kvWidth);
		const long long dst = (long long)meta[t] * kvWidth + d;
		kv_store(kp + dst, k[i]);
		kv_store(vp + dst, v[i]);
	}
}

// kv_write_blocks_q8: one thread a block of B values (Q8_0: 32, Q8_B8: 8)
// of a row's key and of its value.
template <int B>
__device__ void kv_write_blocks_q8(uint8_t* kp, uint8_t* vp, const float* k, const float* v, const int* meta, int T, int kvWidth) {
	const int rowBlocks = kvWidth / B;
	const long long n = (long long)T * rowBlocks;
	GRID_STRIDE(i, n) {
		const int t = (int)(i / rowBlocks), j = (int)(i % rowBlocks);
		const long long dst = ((long long)meta[t] * rowBlocks + j) * (B + 2);
		if (B == 32) {
			quantize_q8_0_block(kp + dst, k + i * B);
			quantize_q8_0_block(vp + dst, v + i * B);
		} else {
			quantize_q8_b8_block(kp + dst, k + i * B);
			quantize_q8_b8_block(vp + dst, v + i * B);
		}
	}
}

extern "C" __global__ void kv_write_blocks_f32(float* kp, float* vp, const float* k, const float* v, const int* meta, int T, int kvWidth) {
	kv_write_blocks(kp, vp, k, v, meta, T, kvWidth);
}
extern "C" __global__ void kv_write_blocks_f16(__half* kp, __half* vp, const float* k, const float* v, const int* meta, int T,
					       int kvWidth) {
	kv_write_blocks(kp, vp, k, v, meta, T, kvWidth);
}
extern "C" __global__ void kv_write_blocks_bf16(bf16* kp, bf16* vp, const float* k, const float* v, const int* meta, int T, int kvWidth) {
	kv_write_blocks(kp, vp, k, v, meta, T, kvWidth);
}
extern "C" __global__ void kv_write_blocks_q8_0(uint8_t* kp, uint8_t* vp, const float* k, const float* v, const int* meta, int T,
						int kvWidth) {
	kv_write_blocks_q8<32>(kp, vp, k, v, meta, T, kvWidth);
}
extern "C" __global__ void kv_write_blocks_q8_b8(uint8_t* kp, uint8_t* vp, const float* k, const float* v, const int* meta, int T,
						 int kvWidth) {
	kv_write_blocks_q8<8>(kp, vp, k, v, meta, T, kvWidth);
}

template <typename KV>
__device__ void attention_blocks(float* out, const float* q, kv_cache<KV> K, kv_cache<KV> V, const int* meta, int T, int heads,
				 int kvHeads, int headDim, int blockSize, float scale) {
	const int h = blockIdx.x, t = blockIdx.y;
	const int kvh = h / (heads / kvHeads);
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const long long qStride = (long long)heads * headDim;
	const int e0 = kvh * headDim;
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
	for (int p = warp; p < npos; p += ATB_WARPS) {
		const long long row = (long long)table[p / blockSize] * blockSize + p % blockSize;
		float s = 0.0f;
#pragma unroll
		for (int i = 0; i < ATB_PER; i++) {
			const int d = lane + 32 * i;
			if (d < headDim) s += qr[i] * K.at(row, e0 + d);
		}
		s = warp_sum(s);
		const float mnew = fmaxf(m, s);
		const float corr = expf(m - mnew);  // 0 on the first position (m = -inf)
		const float e = expf(s - mnew);
		l = l * corr + e;
#pragma unroll
		for (int i = 0; i < ATB_PER; i++) {
			const int d = lane + 32 * i;
			if (d < headDim) acc[i] = acc[i] * corr + e * V.at(row, e0 + d);
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

#define ATB_ENTRY(sfx, KV)                                                                                                     \
	extern "C" __global__ void attention_blocks_##sfx(float* out, const float* q, const KV* kp, const KV* vp, const int* meta, int T, \
							  int heads, int kvHeads, int headDim, int blockSize, float scale) {      \
		const long long stride = (long long)kvHeads * headDim;                                                 \
		attention_blocks<KV>(out, q, kv_cache<KV>{kp, stride}, kv_cache<KV>{vp, stride}, meta, T, heads, kvHeads, headDim, \
				     blockSize, scale);                                                                \
	}
ATB_ENTRY(f32, float)
ATB_ENTRY(f16, __half)
ATB_ENTRY(bf16, bf16)
ATB_ENTRY(q8_0, q8_0)
ATB_ENTRY(q8_b8, q8_b8)
