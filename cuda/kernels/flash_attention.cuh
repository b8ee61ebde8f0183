// Causal grouped-query attention for prefill (many queries), flash-attention
// style, with tensor cores: the arguments of tensor.Ops.Attention (q and
// out F32 [T, heads*D]; caches [maxPos, kvHeads*D] in F32, F16, BF16 or
// Q8_0), for D = 64 or 128. Compiled for compute_80 (mma.sync
// m16n8k16), which the driver compiles for the GPU at hand; the backend
// loads it only on devices of compute capability 8.0 or newer and uses the
// one-block-a-query kernel of attention.cu elsewhere. Each
// flash_attention_<kv>.cu instantiates it for one cache dtype (the PTX of
// all four in one file would pass 100 KB).
//
// Block (i, kvh) owns 64 rows of KV head kvh's group of query heads: row R
// is query R/group of head kvh*group + R%group, so that the group's heads
// share each tile of K and V (tiles taken from the last, the longest,
// first), in 4 warps of 16 rows. It converts its queries, times
// the scale, to F16 in shared memory (BF16 where the cache is BF16), keeps
// each warp's A fragments in registers, then walks the keys 32 at a time
// up to its last query's position: each tile of K and V is read once from
// the cache, converted on the way (a Q8_0 block dequantized) into shared
// memory, V transposed, and every warp computes its 16x32 scores S = Q·Kᵀ
// with mma.sync (F32 accumulators), masks the keys after each row's
// position in the tiles that cross the diagonal, updates its rows' online
// softmax (max and sum in F32, in base 2, across the quad of lanes that
// hold a row), and adds P·V with P rounded to the multiplier type. The T x T scores
// never exist; the output is O / sum in F32. Keys past the last query's
// position are loaded as zeros, so no unwritten cache row is read.
#pragma once

#include "kvcache.cuh"

#define FA_BR 64  // queries a block
#define FA_BC 32  // keys a tile
#define FA_THREADS 128

#ifndef __CUDA_ARCH__
// The host harness (testdata/attnhost.cpp) computes a warp's mma.sync from
// the fragments of its 32 lanes.
void fa_host_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, bool bf);
#endif

// to_mul rounds f to the multipliers' type (nearest even); pack2 rounds
// two, a into the low half (the lower column of a fragment).
__device__ __forceinline__ uint16_t to_mul(float f, bool bf) {
#ifdef __CUDA_ARCH__
	uint16_t r;
	if (bf)
		asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
	else
		asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
	return r;
#else
	return bf ? bf16_from_f32(f).bits : __half_as_ushort(__float2half_rn(f));
#endif
}

__device__ __forceinline__ uint32_t pack2(float a, float b, bool bf) {
#ifdef __CUDA_ARCH__
	uint32_t r;
	if (bf)
		asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
	else
		asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
	return r;
#else
	return (uint32_t)to_mul(a, bf) | ((uint32_t)to_mul(b, bf) << 16);
#endif
}

template <bool BF>
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#ifdef __CUDA_ARCH__
	if (BF) {
		asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
		    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
	} else {
		asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
		    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
	}
#else
	fa_host_mma(c, a, b0, b1, BF);
#endif
}

template <typename KV, int D, bool BF>
__device__ void flash_prefill(float* out, const float* q, kv_cache<KV> K, kv_cache<KV> V, int T, int heads, int kvHeads, int pos0,
			      float scale) {
	constexpr int QS = D + 8;      // row stride of sQ and sK in elements: rows 4 banks apart
	constexpr int VS = FA_BC + 8;  // row stride of the transposed V
	__shared__ __align__(16) uint16_t sQ[FA_BR * QS];
	__shared__ __align__(16) uint16_t sK[FA_BC * QS];
	__shared__ __align__(16) uint16_t sV[D * VS];

	const int qt = gridDim.x - 1 - blockIdx.x;
	const int kvh = blockIdx.y, group = heads / kvHeads;
	const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
	const int r0 = qt * FA_BR;  // the block's first row
	const long long qStride = (long long)heads * D;
	const float qs = scale * 1.4426950408889634f;  // scores in base 2, for exp2f

	for (int i = tid; i < FA_BR * D / 8; i += FA_THREADS) {
		const int r = i / (D / 8), c = (i % (D / 8)) * 8;
		float f[8];
		const int t = (r0 + r) / group, h = kvh * group + (r0 + r) % group;
		if (t < T) {
			const float4* p = (const float4*)(q + t * qStride + (long long)h * D + c);
			const float4 a = p[0], b = p[1];
			f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
		} else {
#pragma unroll
			for (int j = 0; j < 8; j++) f[j] = 0.0f;
		}
		uint4 u;
		u.x = pack2(f[0] * qs, f[1] * qs, BF);
		u.y = pack2(f[2] * qs, f[3] * qs, BF);
		u.z = pack2(f[4] * qs, f[5] * qs, BF);
		u.w = pack2(f[6] * qs, f[7] * qs, BF);
		*(uint4*)&sQ[r * QS + c] = u;
	}
	__syncthreads();
	uint32_t qa[D / 16][4];
#pragma unroll
	for (int kk = 0; kk < D / 16; kk++) {
		const uint16_t* b = sQ + (warp * 16) * QS + kk * 16 + tig * 2;
		qa[kk][0] = *(const uint32_t*)(b + g * QS);
		qa[kk][1] = *(const uint32_t*)(b + (g + 8) * QS);
		qa[kk][2] = *(const uint32_t*)(b + g * QS + 8);
		qa[kk][3] = *(const uint32_t*)(b + (g + 8) * QS + 8);
	}

	float o[D / 8][4];
#pragma unroll
	for (int j = 0; j < D / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
	float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
	const int wr = r0 + warp * 16;  // the warp's first row
	const int wpos = pos0 + wr / group, wend = pos0 + (wr + 15) / group;  // its rows' first and last positions
	const int rowpos[2] = {pos0 + (wr + g) / group, pos0 + (wr + g + 8) / group};
	const int last = pos0 + min((r0 + FA_BR - 1) / group, T - 1);  // the last key a row of the block sees
	const int e0 = kvh * D;

	for (int kb = 0; kb <= last; kb += FA_BC) {
		__syncthreads();  // every warp is done with the previous tile
		// A warp takes the 32 keys of 8 columns: its stores of the
		// transposed V fill 16 banks' words, two lanes to a word, and its
		// 16-byte stores of K four banks a lane, without conflicts.
		for (int i = tid; i < FA_BC * D / 8; i += FA_THREADS) {
			const int r = i % FA_BC, c = (i / FA_BC) * 8;
			const int p = kb + r;
			float kf[8], vf[8];
			if (p <= last) {
				K.load8(p, e0 + c, kf);
				V.load8(p, e0 + c, vf);
			} else {
#pragma unroll
				for (int j = 0; j < 8; j++) kf[j] = vf[j] = 0.0f;
			}
			uint4 u;
			u.x = pack2(kf[0], kf[1], BF);
			u.y = pack2(kf[2], kf[3], BF);
			u.z = pack2(kf[4], kf[5], BF);
			u.w = pack2(kf[6], kf[7], BF);
			*(uint4*)&sK[r * QS + c] = u;
#pragma unroll
			for (int j = 0; j < 8; j++) sV[(c + j) * VS + r] = to_mul(vf[j], BF);
		}
		__syncthreads();
		if (kb > wend) continue;  // every key of the tile is after this warp's rows

		float s[FA_BC / 8][4];
#pragma unroll
		for (int nt = 0; nt < FA_BC / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
		for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
			for (int nt = 0; nt < FA_BC / 8; nt++) {
				const uint16_t* b = sK + (nt * 8 + g) * QS + kk * 16 + tig * 2;
				mma16816<BF>(s[nt], qa[kk], *(const uint32_t*)b, *(const uint32_t*)(b + 8));
			}
		}
		if (kb + FA_BC - 1 > wpos) {  // the tile crosses some row's position
#pragma unroll
			for (int nt = 0; nt < FA_BC / 8; nt++)
#pragma unroll
				for (int j = 0; j < 4; j++)
					if (kb + nt * 8 + tig * 2 + (j & 1) > rowpos[j >> 1]) s[nt][j] = -INFINITY;
		}
#pragma unroll
		for (int r = 0; r < 2; r++) {
			float mx = -INFINITY;
#pragma unroll
			for (int nt = 0; nt < FA_BC / 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
			mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
			mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
			// Key 0 is in the first tile and every row sees it: m is
			// finite from then on, and mnew with it.
			const float mnew = fmaxf(m[r], mx);
			const float corr = exp2f(m[r] - mnew);
			float sum = 0.0f;
#pragma unroll
			for (int nt = 0; nt < FA_BC / 8; nt++) {
				s[nt][2 * r] = exp2f(s[nt][2 * r] - mnew);
				s[nt][2 * r + 1] = exp2f(s[nt][2 * r + 1] - mnew);
				sum += s[nt][2 * r] + s[nt][2 * r + 1];
			}
			sum += __shfl_xor_sync(0xffffffffu, sum, 1);
			sum += __shfl_xor_sync(0xffffffffu, sum, 2);
			l[r] = l[r] * corr + sum;
			m[r] = mnew;
#pragma unroll
			for (int j = 0; j < D / 8; j++) {
				o[j][2 * r] *= corr;
				o[j][2 * r + 1] *= corr;
			}
		}
#pragma unroll
		for (int kk = 0; kk < FA_BC / 16; kk++) {
			uint32_t a[4];
			a[0] = pack2(s[2 * kk][0], s[2 * kk][1], BF);
			a[1] = pack2(s[2 * kk][2], s[2 * kk][3], BF);
			a[2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], BF);
			a[3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], BF);
#pragma unroll
			for (int j = 0; j < D / 8; j++) {
				const uint16_t* b = sV + (j * 8 + g) * VS + kk * 16 + tig * 2;
				mma16816<BF>(o[j], a, *(const uint32_t*)b, *(const uint32_t*)(b + 8));
			}
		}
	}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		const int row = wr + g + 8 * r, t = row / group, h = kvh * group + row % group;
		if (t >= T) continue;
		const float inv = 1.0f / l[r];
		float* orow = out + t * qStride + (long long)h * D + tig * 2;
#pragma unroll
		for (int j = 0; j < D / 8; j++) *(float2*)(orow + j * 8) = make_float2(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
	}
}

#define FLASH_ENTRY(sfx, KV, D, BF)                                                                                                     \
	extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_##sfx##_d##D(                                      \
	    float* out, const float* q, const KV* k, const KV* v, int T, int heads, int kvHeads, int pos0, float scale) {          \
		const long long stride = (long long)kvHeads * D;                                                                \
		flash_prefill<KV, D, BF>(out, q, kv_cache<KV>{k, stride}, kv_cache<KV>{v, stride}, T, heads, kvHeads, pos0, scale); \
	}
