// attnhost runs the bodies of the long-context attention kernels
// (kernels/attention_split.cuh, kernels/flash_attention.cuh) on the CPU,
// for attnhost_test.go: compiled as plain C++ (nvcc -x c++), one host
// thread per GPU thread of a block, the blocks of a launch one after
// another, so that a function's static arrays serve as the block's shared
// memory. Barriers stand for __syncthreads and for the lanes of a warp
// exchanging values (__shfl_xor_sync, __shfl_sync, and mma.sync, whose product this
// file computes from the 32 lanes' fragments as the PTX manual lays them
// out). kvhost_check counts every cache read outside the rows written or
// misaligned for its load.
//
// Requests on stdin, responses on stdout, all little-endian:
//   request:  int32 op (0 end, 1 split decode, 2 tiled prefill), int32 dtype
//             (0 F32, 1 F16, 2 BF16, 3 Q8_0, 4 Q8_B8), int32 D, heads, kvHeads, T,
//             pos0, maxPos, chunk, splits, posAt (-1: none; else the
//             position the split kernel reads from device memory, pos0
//             then its bound), float32 scale, then T*heads*D float32 q,
//             and the k and v caches' bytes (maxPos rows each)
//   response: int64 violations, then T*heads*D float32 out
// or, for the paged cache's kernels (attention_blocks.cu: kv_write_blocks
// then attention_blocks, launched as cuda/ops.go launches them):
//   request:  int32 op 4, int32 dtype, heads, kvHeads, D, blockSize, T,
//             poolRows, nmeta, float32 scale, then nmeta int32 meta,
//             T*heads*D float32 q, T*kvHeads*D float32 k and v, and the
//             pools' bytes (poolRows rows each)
//   response: int64 violations, T*heads*D float32 out, the pools' bytes
// or, for the rotation into quantized caches (kvcache.cuh's rope_kv_q8):
//   request:  int32 op 5, int32 dtype (3 Q8_0, 4 Q8_B8), T, heads, kvHeads,
//             D, p0, then T*heads*D float32 q, T*kvHeads*D float32 k and
//             v, (p0+T)*D/2 float32 cos and sin
//   response: T*heads*D float32 q rotated, then the k and v caches' bytes
//             (p0+T rows each; rows before p0 are left 0xa5)
// or, to check the caches' quantizers (kvcache.cuh) byte for byte:
//   request:  int32 op 3, int32 dtype (3 Q8_0, 4 Q8_B8), int32 n, then n
//             float32 values (whole blocks)
//   response: the blocks' bytes
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#define HOSTRT_NAME "attnhost"
#define HOSTRT_CUDA_AS_CPP
#include "hostrt.h"

// Newer cuda_fp16.h (CUDA 13) declares these two for the host as well;
// the harness's own versions go by other names, and the kernels' calls
// are renamed to them.
static inline unsigned short host_half_as_ushort(__half h) {
	unsigned short u;
	memcpy(&u, &h, 2);
	return u;
}
static inline __half host_ushort_as_half(unsigned short u) {
	__half h;
	memcpy(&h, &u, 2);
	return h;
}
#define __half_as_ushort host_half_as_ushort
#define __ushort_as_half host_ushort_as_half
static inline float __fmul_rn(float a, float b) { return a * b; }

struct Warp {
	Barrier bar{32};
	float f[32];
	uint32_t a[32][4], b[32][2];
};

struct Block {
	Barrier all;
	std::vector<Warp*> warps;
	explicit Block(int nthreads) : all(nthreads) {
		for (int i = 0; i < nthreads / 32; i++) warps.push_back(new Warp);
	}
	~Block() {
		for (Warp* w : warps) delete w;
	}
};
static thread_local Block* tblock;

static inline Warp* my_warp() { return tblock->warps[threadIdx.x / 32]; }
static inline void __syncthreads() { tblock->all.wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
	Warp* w = my_warp();
	const int lane = threadIdx.x & 31;
	w->f[lane] = v;
	w->bar.wait();
	const float r = w->f[lane ^ o];
	w->bar.wait();
	return r;
}

// The value of v in lane src of the warp.
static inline int __shfl_sync(unsigned, int v, int src) {
	Warp* w = my_warp();
	const int lane = threadIdx.x & 31;
	memcpy(&w->f[lane], &v, 4);
	w->bar.wait();
	int r;
	memcpy(&r, &w->f[src & 31], 4);
	w->bar.wait();
	return r;
}

#include "../kernels/attention_split.cuh"
#include "../kernels/flash_attention.cuh"
#include "../kernels/attention_blocks.cu"

// fa_host_mma: D = A·B + C for the 16x16 A (row-major), 16x8 B and 16x8 C
// held across the warp as mma.sync.m16n8k16.row.col lays them out.
static float mul_to_f32(uint16_t u, bool bf) {
	if (bf) return __uint_as_float((uint32_t)u << 16);
	return __half2float(__ushort_as_half(u));
}
void fa_host_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, bool bf) {
	Warp* w = my_warp();
	const int lane = threadIdx.x & 31;
	for (int i = 0; i < 4; i++) w->a[lane][i] = a[i];
	w->b[lane][0] = b0;
	w->b[lane][1] = b1;
	w->bar.wait();
	float A[16][16], B[16][8];
	for (int l = 0; l < 32; l++) {
		const int g = l >> 2, t = l & 3;
		for (int h = 0; h < 2; h++) {
			const int sh = 16 * h;
			A[g][2 * t + h] = mul_to_f32((uint16_t)(w->a[l][0] >> sh), bf);
			A[g + 8][2 * t + h] = mul_to_f32((uint16_t)(w->a[l][1] >> sh), bf);
			A[g][2 * t + 8 + h] = mul_to_f32((uint16_t)(w->a[l][2] >> sh), bf);
			A[g + 8][2 * t + 8 + h] = mul_to_f32((uint16_t)(w->a[l][3] >> sh), bf);
			B[2 * t + h][g] = mul_to_f32((uint16_t)(w->b[l][0] >> sh), bf);
			B[2 * t + 8 + h][g] = mul_to_f32((uint16_t)(w->b[l][1] >> sh), bf);
		}
	}
	w->bar.wait();
	const int g = lane >> 2, t = lane & 3;
	for (int i = 0; i < 4; i++) {
		const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
		float s = 0.0f;
		for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
		c[i] += s;
	}
}

// The cache rows a launch may read: [lo, hi) of k and of v.
static const uint8_t *klo, *khi, *vlo, *vhi;
static std::atomic<long long> violations;
static const int* pos_at;  // the split kernel's posAt, or null
void kvhost_check(const void* p, int n, int align) {
	const uint8_t* b = (const uint8_t*)p;
	const bool in = (b >= klo && b + n <= khi) || (b >= vlo && b + n <= vhi);
	if (!in || ((uintptr_t)b % align) != 0) violations++;
}

// launch runs kernel() for every thread of grid x block, a block at a time.
template <class K>
static void launch(dim3 grid, int threads, K kernel) {
	gridDim = grid;
	blockDim = dim3(threads, 1, 1);
	for (unsigned z = 0; z < grid.z; z++)
		for (unsigned y = 0; y < grid.y; y++)
			for (unsigned x = 0; x < grid.x; x++) {
				Block blk(threads);
				std::vector<std::thread> ts;
				for (int t = 0; t < threads; t++)
					ts.emplace_back([&, t] {
						tblock = &blk;
						threadIdx = make_uint3(t, 0, 0);
						blockIdx = make_uint3(x, y, z);
						kernel();
					});
				for (std::thread& t : ts) t.join();
			}
}


template <typename KV>
static void run(int op, int D, int heads, int kvHeads, int T, int pos0, int maxPos, int chunk, int splits, float scale, const float* q,
		const uint8_t* k, const uint8_t* v, float* out) {
	const KV* kp = (const KV*)k;
	const KV* vp = (const KV*)v;
	std::vector<float> part((size_t)heads * T * splits * (D + 2), NAN);
	float* pp = part.data();
	// The splits count themselves (the GPU's path): the last block of a
	// head merges. attention_merge, the path without counts, must then
	// give the same bits from the same partials; the counts must be back
	// at zero.
	std::vector<int> count((size_t)heads * T, 0);
	std::vector<float> merged((size_t)T * heads * D);
#define SPLIT(DD)                                                                                                                 \
	case DD:                                                                                                                  \
		launch(dim3(heads, T, splits), 128, [&] {                                                                         \
			attention_split<KV, DD>(out, pp, q, kv_cache<KV>{kp, (long long)kvHeads * DD}, kv_cache<KV>{vp, (long long)kvHeads * DD}, \
						heads, kvHeads, pos0, scale, chunk, pos_at, count.data());                            \
		});                                                                                                       \
		if (splits > 1) {                                                                                         \
			launch(dim3(heads, T, 1), 128, [&] { attention_merge<DD>(merged.data(), pp, heads, splits); });   \
			if (memcmp(merged.data(), out, merged.size() * 4) != 0) {                                         \
				fprintf(stderr, "attnhost: the last split block's merge differs from attention_merge\n");  \
				exit(3);                                                                                  \
			}                                                                                                 \
			for (int c : count)                                                                               \
				if (c != 0) {                                                                             \
					fprintf(stderr, "attnhost: a split count left at %d\n", c);                      \
					exit(3);                                                                          \
				}                                                                                         \
		}                                                                                                         \
		break;
#define FLASH(DD, BF)                                                                                                              \
	case DD:                                                                                                                   \
		launch(dim3((T * (heads / kvHeads) + FA_BR - 1) / FA_BR, kvHeads, 1), FA_THREADS, [&] {                            \
			flash_prefill<KV, DD, BF>(out, q, kv_cache<KV>{kp, (long long)kvHeads * DD}, kv_cache<KV>{vp, (long long)kvHeads * DD}, T, \
						  heads, kvHeads, pos0, scale);                                                     \
		});                                                                                                        \
		break;
	if (op == 1) {
		switch (D) {
			SPLIT(64)
			SPLIT(128)
			SPLIT(256)
		default:
			fprintf(stderr, "attnhost: split D = %d\n", D);
			exit(2);
		}
	} else {
		constexpr bool bf = std::is_same<KV, bf16>::value;
		switch (D) {
			FLASH(64, bf)
			FLASH(128, bf)
		default:
			fprintf(stderr, "attnhost: flash D = %d\n", D);
			exit(2);
		}
	}
}

int main() {
	for (;;) {
		const int op = read32();
		if (op == 0) return 0;
		if (op == 4) {
			const int dt = read32(), heads = read32(), kvHeads = read32(), D = read32(), bs = read32(), T = read32(),
				  poolRows = read32(), nmeta = read32();
			float scale;
			readn(&scale, 4);
			const size_t qn = (size_t)T * heads * D, width = (size_t)kvHeads * D;
			const size_t rowBytes = dt == 0 ? 4 * width : dt == 3 ? width / 32 * 34 : dt == 4 ? width / 8 * 10 : 2 * width;
			std::vector<int> meta(nmeta);
			readn(meta.data(), (size_t)nmeta * 4);
			std::vector<float> q(qn), k(T * width), v(T * width), out(qn, NAN);
			readn(q.data(), qn * 4);
			readn(k.data(), k.size() * 4);
			readn(v.data(), v.size() * 4);
			std::vector<uint8_t> kb(rowBytes * poolRows + 256), vb(rowBytes * poolRows + 256);
			uint8_t* kp = kb.data() + ((256 - ((uintptr_t)kb.data() & 255)) & 255);
			uint8_t* vp = vb.data() + ((256 - ((uintptr_t)vb.data() & 255)) & 255);
			readn(kp, rowBytes * poolRows);
			readn(vp, rowBytes * poolRows);
			// Any pool row may be read: a wrong one holds NaN.
			klo = kp, khi = kp + rowBytes * poolRows;
			vlo = vp, vhi = vp + rowBytes * poolRows;
			violations = 0;
			const int bsz = dt == 3 ? 32 : dt == 4 ? 8 : 1;
			const long long nthreads = (long long)T * width / bsz;
			const int wgrid = (int)((nthreads + 255) / 256);
			auto write = [&] {
				switch (dt) {
				case 0: kv_write_blocks_f32((float*)kp, (float*)vp, k.data(), v.data(), meta.data(), T, (int)width); break;
				case 1: kv_write_blocks_f16((__half*)kp, (__half*)vp, k.data(), v.data(), meta.data(), T, (int)width); break;
				case 2: kv_write_blocks_bf16((bf16*)kp, (bf16*)vp, k.data(), v.data(), meta.data(), T, (int)width); break;
				case 3: kv_write_blocks_q8_0(kp, vp, k.data(), v.data(), meta.data(), T, (int)width); break;
				case 4: kv_write_blocks_q8_b8(kp, vp, k.data(), v.data(), meta.data(), T, (int)width); break;
				}
			};
			launch(dim3(wgrid, 1, 1), 256, write);
			auto attend = [&] {
				switch (dt) {
				case 0: attention_blocks_f32(out.data(), q.data(), (float*)kp, (float*)vp, meta.data(), T, heads, kvHeads, D, bs, scale); break;
				case 1: attention_blocks_f16(out.data(), q.data(), (__half*)kp, (__half*)vp, meta.data(), T, heads, kvHeads, D, bs, scale); break;
				case 2: attention_blocks_bf16(out.data(), q.data(), (bf16*)kp, (bf16*)vp, meta.data(), T, heads, kvHeads, D, bs, scale); break;
				case 3: attention_blocks_q8_0(out.data(), q.data(), (q8_0*)kp, (q8_0*)vp, meta.data(), T, heads, kvHeads, D, bs, scale); break;
				case 4: attention_blocks_q8_b8(out.data(), q.data(), (q8_b8*)kp, (q8_b8*)vp, meta.data(), T, heads, kvHeads, D, bs, scale); break;
				}
			};
			launch(dim3(heads, T, 1), 256, attend);
			const long long nv = violations;
			fwrite(&nv, 8, 1, stdout);
			fwrite(out.data(), 4, qn, stdout);
			fwrite(kp, 1, rowBytes * poolRows, stdout);
			fwrite(vp, 1, rowBytes * poolRows, stdout);
			continue;
		}
		if (op == 5) {
			const int dt = read32(), T = read32(), heads = read32(), kvHeads = read32(), D = read32(), p0 = read32();
			const size_t qn = (size_t)T * heads * D, width = (size_t)kvHeads * D, tab = (size_t)(p0 + T) * (D / 2);
			const size_t rowBytes = dt == 3 ? width / 32 * 34 : width / 8 * 10, cacheBytes = rowBytes * (p0 + T);
			std::vector<float> q(qn), k(T * width), v(T * width), cosT(tab), sinT(tab);
			readn(q.data(), qn * 4);
			readn(k.data(), k.size() * 4);
			readn(v.data(), v.size() * 4);
			readn(cosT.data(), tab * 4);
			readn(sinT.data(), tab * 4);
			std::vector<uint8_t> kc(cacheBytes, 0xa5), vc(cacheBytes, 0xa5);
			// A grid of at most 4 blocks: the threads stride over the rest.
			const long long n = ((long long)2 * T * width + 31) / 32 * 32 + (long long)T * heads * (D / 2);
			launch(dim3((unsigned)std::min<long long>((n + 255) / 256, 4), 1, 1), 256, [&] {
				if (dt == 3)
					rope_kv_q8<32>(q.data(), k.data(), v.data(), kc.data(), vc.data(), cosT.data(), sinT.data(), T, heads, kvHeads, D, p0);
				else
					rope_kv_q8<8>(q.data(), k.data(), v.data(), kc.data(), vc.data(), cosT.data(), sinT.data(), T, heads, kvHeads, D, p0);
			});
			fwrite(q.data(), 4, qn, stdout);
			fwrite(kc.data(), 1, cacheBytes, stdout);
			fwrite(vc.data(), 1, cacheBytes, stdout);
			continue;
		}
		if (op == 3) {
			const int dt = read32(), n = read32();
			std::vector<float> x(n);
			readn(x.data(), (size_t)n * 4);
			const int bs = dt == 3 ? 32 : 8, bb = bs + 2;
			std::vector<uint8_t> b((size_t)n / bs * bb);
			for (int i = 0; i < n / bs; i++) {
				if (dt == 3)
					quantize_q8_0_block(b.data() + (size_t)bb * i, x.data() + (size_t)bs * i);
				else
					quantize_q8_b8_block(b.data() + (size_t)bb * i, x.data() + (size_t)bs * i);
			}
			fwrite(b.data(), 1, b.size(), stdout);
			continue;
		}
		const int dt = read32(), D = read32(), heads = read32(), kvHeads = read32(), T = read32(), pos0 = read32(), maxPos = read32(),
			  chunk = read32(), splits = read32(), posAt = read32();
		float scale;
		readn(&scale, 4);
		const size_t qn = (size_t)T * heads * D, width = (size_t)kvHeads * D;
		const size_t rowBytes = dt == 0 ? 4 * width : dt == 3 ? width / 32 * 34 : dt == 4 ? width / 8 * 10 : 2 * width;
		std::vector<float> q(qn), out(qn, NAN);
		readn(q.data(), qn * 4);
		// The caches at 256-byte boundaries, as the allocator gives them.
		std::vector<uint8_t> kb(rowBytes * maxPos + 256), vb(rowBytes * maxPos + 256);
		uint8_t* k = kb.data() + ((256 - ((uintptr_t)kb.data() & 255)) & 255);
		uint8_t* v = vb.data() + ((256 - ((uintptr_t)vb.data() & 255)) & 255);
		readn(k, rowBytes * maxPos);
		readn(v, rowBytes * maxPos);
		const int written = (posAt >= 0 ? posAt : pos0) + T;
		klo = k, khi = k + rowBytes * written;
		vlo = v, vhi = v + rowBytes * written;
		const int posAtValue = posAt;
		pos_at = posAt >= 0 ? &posAtValue : nullptr;
		violations = 0;
		switch (dt) {
		case 0:
			run<float>(op, D, heads, kvHeads, T, pos0, maxPos, chunk, splits, scale, q.data(), k, v, out.data());
			break;
		case 1:
			run<__half>(op, D, heads, kvHeads, T, pos0, maxPos, chunk, splits, scale, q.data(), k, v, out.data());
			break;
		case 2:
			run<bf16>(op, D, heads, kvHeads, T, pos0, maxPos, chunk, splits, scale, q.data(), k, v, out.data());
			break;
		case 3:
			run<q8_0>(op, D, heads, kvHeads, T, pos0, maxPos, chunk, splits, scale, q.data(), k, v, out.data());
			break;
		case 4:
			run<q8_b8>(op, D, heads, kvHeads, T, pos0, maxPos, chunk, splits, scale, q.data(), k, v, out.data());
			break;
		}
		const long long nv = violations;
		fwrite(&nv, 8, 1, stdout);
		fwrite(out.data(), 4, qn, stdout);
	}
}
