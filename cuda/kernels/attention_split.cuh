// Decode attention over long caches, flash-decoding style: a few queries
// (tensor.Ops.Attention's arguments, see attention.cu), the positions of
// each split across blocks. Instantiated for one head dimension D by each
// attention_split_d<D>.cu, for every cache dtype:
//
// attention_split_<kv>_d<D>: block (h, t, s) walks the positions
// [s*chunk, (s+1)*chunk) of query t's head h: D/8 lanes hold one
// position's head, 8 values each (one 16-byte load of F16), so a warp reads
// 32/(D/8) positions at once and its 4 warps several more, two steps in
// flight; each lane group keeps its own online softmax, merged through
// shuffles and shared memory at the end. With one split the block writes
// the output; otherwise it writes its partial (max, sum, weighted sum of V)
// to part, and the last of the head's blocks to finish (counted in count)
// rescales and adds the splits, or without count attention_merge_d<D>, a
// launch of its own. Scores are kept in base 2 (q is scaled by
// scale*log2(e)) for exp2f.
#pragma once

#include "kvcache.cuh"
#include "step.cuh"

#define SPLIT_WARPS 4
// SPLIT_MAX is splitMax of cuda/attnplan.go: the most splits of a query.
#define SPLIT_MAX 128

// merge2 folds the online-softmax state (m2, l2, a2) into (m, l, a).
template <int N>
__device__ __forceinline__ void merge2(float& m, float& l, float a[N], float m2, float l2, const float a2[N]) {
	const float M = fmaxf(m, m2);
	const float f1 = m == -INFINITY ? 0.0f : exp2f(m - M);
	const float f2 = m2 == -INFINITY ? 0.0f : exp2f(m2 - M);
	l = l * f1 + l2 * f2;
#pragma unroll
	for (int i = 0; i < N; i++) a[i] = a[i] * f1 + a2[i] * f2;
	m = M;
}

template <int D>
__device__ void merge_splits(float* out, const float* part, int heads, int splits, int h, int t);

// A partial result is D+2 floats: the max, the sum, then the weighted sum
// of V, unnormalised; record (h, t, s) at ((t*heads + h)*splits + s).
template <typename KV, int D>
__device__ void attention_split(float* out, float* part, const float* q, kv_cache<KV> K, kv_cache<KV> V, int heads, int kvHeads,
				int pos0, float scale, int chunk, const int* posAt, int* count) {
	// In a captured graph the position is read when the kernel runs
	// (tensor.Attn.PosAt), up to the pos0 the splits were planned for;
	// splits past it write empty partials.
	if (posAt) pos0 = min(max(*posAt, 0), pos0);
	constexpr int LPP = D / 8;        // lanes a position
	constexpr int PPW = 32 / LPP;     // positions a warp step
	constexpr int PPB = SPLIT_WARPS * PPW;
	const int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z, splits = gridDim.z;
	const int kvh = h / (heads / kvHeads);
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int sub = lane / LPP, li = lane % LPP;
	const long long qStride = (long long)heads * D;
	const int n = pos0 + t + 1;
	const int p0 = s * chunk, p1 = min(n, p0 + chunk);
	const int e0 = kvh * D + li * 8;

	float qr[8], acc[8];
	{
		const float4* qp = (const float4*)(q + t * qStride + (long long)h * D + li * 8);
		const float4 a = qp[0], b = qp[1];
		qr[0] = a.x, qr[1] = a.y, qr[2] = a.z, qr[3] = a.w, qr[4] = b.x, qr[5] = b.y, qr[6] = b.z, qr[7] = b.w;
	}
#pragma unroll
	for (int i = 0; i < 8; i++) {
		qr[i] *= scale * 1.4426950408889634f;  // log2(e)
		acc[i] = 0.0f;
	}
	float m = -INFINITY, l = 0.0f;
	// Two steps a pass: both positions' loads are issued before the
	// arithmetic. Every lane runs every pass (the shuffles need the whole
	// warp); lanes past p1 load nothing and change nothing.
	for (int base = p0 + warp * PPW; base < p1; base += 2 * PPB) {
		float kf[2][8], vf[2][8];
		int p[2];
		bool ok[2];
#pragma unroll
		for (int u = 0; u < 2; u++) {
			p[u] = base + u * PPB + sub;
			ok[u] = p[u] < p1;
			if (ok[u]) {
				K.load8(p[u], e0, kf[u]);
				V.load8(p[u], e0, vf[u]);
			} else {
#pragma unroll
				for (int i = 0; i < 8; i++) kf[u][i] = vf[u][i] = 0.0f;
			}
		}
#pragma unroll
		for (int u = 0; u < 2; u++) {
			float sc = 0.0f;
#pragma unroll
			for (int i = 0; i < 8; i++) sc += qr[i] * kf[u][i];
#pragma unroll
			for (int o = LPP / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
			if (ok[u]) {
				const float mnew = fmaxf(m, sc);
				const float corr = exp2f(m - mnew);
				const float e = exp2f(sc - mnew);
				l = l * corr + e;
#pragma unroll
				for (int i = 0; i < 8; i++) acc[i] = acc[i] * corr + e * vf[u][i];
				m = mnew;
			}
		}
	}
	// The warp's lane groups (same li, other sub) merge by shuffles.
#pragma unroll
	for (int o = LPP; o < 32; o <<= 1) {
		float a2[8];
		const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
#pragma unroll
		for (int i = 0; i < 8; i++) a2[i] = __shfl_xor_sync(0xffffffffu, acc[i], o);
		merge2<8>(m, l, acc, m2, l2, a2);
	}
	__shared__ float sm[SPLIT_WARPS], sl[SPLIT_WARPS];
	__shared__ float sacc[SPLIT_WARPS][D];
	if (sub == 0) {
#pragma unroll
		for (int i = 0; i < 8; i++) sacc[warp][li * 8 + i] = acc[i];
		if (li == 0) {
			sm[warp] = m;
			sl[warp] = l;
		}
	}
	__syncthreads();
	float M = -INFINITY;
	for (int w = 0; w < SPLIT_WARPS; w++) M = fmaxf(M, sm[w]);
	float L = 0.0f;
	for (int w = 0; w < SPLIT_WARPS; w++)
		if (sm[w] != -INFINITY) L += sl[w] * exp2f(sm[w] - M);
	float* rec = part + (((long long)t * heads + h) * splits + s) * (D + 2);
	for (int d = threadIdx.x; d < D; d += blockDim.x) {
		float num = 0.0f;
		for (int w = 0; w < SPLIT_WARPS; w++)
			if (sm[w] != -INFINITY) num += sacc[w][d] * exp2f(sm[w] - M);
		if (splits == 1)
			out[t * qStride + (long long)h * D + d] = num / L;
		else
			rec[2 + d] = num;
	}
	if (splits > 1 && threadIdx.x == 0) {
		rec[0] = M;
		rec[1] = L;
	}
	if (splits == 1 || count == nullptr) return;  // attention_merge follows
	// The splits count themselves in count[t*heads + h]: the last to
	// finish merges the head's partials, its own launch's, and sets the
	// count back to zero for the next launch (a graph's replay).
	__shared__ int last;
	__threadfence();  // this block's partial is visible before its count
	__syncthreads();
	if (threadIdx.x == 0) {
		int* c = count + (long long)t * heads + h;
		last = atomicAdd(c, 1) == splits - 1;
		if (last) *c = 0;
	}
	__syncthreads();
	if (!last) return;
	__threadfence();
	merge_splits<D>(out, part, heads, splits, h, t);
}

// merge_splits adds the splits' partials of query t's head h into out,
// each rescaled to the largest max: what attention_merge does, and the
// last split block of a head where the splits count themselves. The
// splits' maxima and sums are read once, all at a time, into shared
// memory with their factors; each thread then reads its value of every
// split, the loads in flight together (a loop over the records' headers,
// one load after another, took 4.4 us for 32 splits on the H200). The
// loads skip L1 (ld.cg), which does not see other blocks' writes.
template <int D>
__device__ void merge_splits(float* out, const float* part, int heads, int splits, int h, int t) {
	__shared__ float sf[SPLIT_MAX], sl[SPLIT_MAX];
	const float* rec = part + ((long long)t * heads + h) * splits * (D + 2);
	for (int s = threadIdx.x; s < splits; s += blockDim.x) {
		sf[s] = __ldcg(rec + s * (D + 2));
		sl[s] = __ldcg(rec + s * (D + 2) + 1);
	}
	__syncthreads();
	float M = -INFINITY;
	for (int s = 0; s < splits; s++) M = fmaxf(M, sf[s]);
	__syncthreads();  // every thread has read the maxima
	// A split past query t's positions (max -inf) weighs nothing.
	for (int s = threadIdx.x; s < splits; s += blockDim.x) sf[s] = sf[s] == -INFINITY ? 0.0f : exp2f(sf[s] - M);
	__syncthreads();
	float den = 0.0f;
	for (int s = 0; s < splits; s++)
		if (sf[s] != 0.0f) den += sl[s] * sf[s];
	for (int d = threadIdx.x; d < D; d += blockDim.x) {
		float num = 0.0f;
#pragma unroll 8
		for (int s = 0; s < splits; s++) {
			const float v = __ldcg(rec + s * (D + 2) + 2 + d);
			if (sf[s] != 0.0f) num += v * sf[s];
		}
		out[t * (long long)heads * D + (long long)h * D + d] = num / den;
	}
}

// attention_merge: block (h, t) merges query t's head h (merge_splits),
// after an attention_split launch without counts.
template <int D>
__device__ void attention_merge(float* out, const float* part, int heads, int splits) {
	merge_splits<D>(out, part, heads, splits, blockIdx.x, blockIdx.y);
}

#define SPLIT_ENTRY(sfx, KV, D)                                                                                                     \
	extern "C" __global__ void STEP_KERNEL(attention_split_##sfx##_d##D)(float* out, float* part, const float* q, const KV* k,  \
									      const KV* v, int heads, int kvHeads, int pos0, float scale, \
									      int chunk, const int* posAt, int* count) {                 \
		step_begin();                                                                                                   \
		const long long stride = (long long)kvHeads * D;                                                            \
		attention_split<KV, D>(out, part, q, kv_cache<KV>{k, stride}, kv_cache<KV>{v, stride}, heads, kvHeads, pos0, scale, \
				       chunk, posAt, count);                                                                 \
	}
#define SPLIT_ENTRIES(D)              \
	SPLIT_ENTRY(f32, float, D)    \
	SPLIT_ENTRY(f16, __half, D)   \
	SPLIT_ENTRY(bf16, bf16, D)    \
	SPLIT_ENTRY(q8_0, q8_0, D)    \
	SPLIT_ENTRY(q8_b8, q8_b8, D)  \
	extern "C" __global__ void STEP_KERNEL(attention_merge_d##D)(float* out, const float* part, int heads, int splits) { \
		step_begin();                                                                                                \
		attention_merge<D>(out, part, heads, splits);                                                                \
	}
