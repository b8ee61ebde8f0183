// Decode attention over long caches, flash-decoding style: a few queries
// (tensor.Ops.Attention's arguments, see attention.cu), the positions of
// each split across blocks. Instantiated for one head dimension D by each
// attention_split_d<D>.cu, for every cache dtype:
//
// attention_split_<kv>_d<D>: block (h, t, s) walks the positions
// [s*chunk, (s+1)*chunk) of query t's head h: D/8 lanes hold one
// position's head, 8 values each (one 16-byte load of F16), so a warp reads
// 32/(D/8) positions at once and its 4 warps several more, a pass of
// SPLIT_STEPS positions a lane group in flight (kv_cache_q8w reads Q8_0
// heads of 128 or 256 values; kvcache.cuh); each lane group keeps its own
// online softmax, merged through
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
// SPLIT_STEPS is how many positions' loads a lane group has in flight
// (split_steps: two for F32 caches). cuda/attnplan.go's splitPass is the
// positions a block takes a pass, SPLIT_WARPS * (32 / (D/8)) * steps.
#define SPLIT_STEPS 4
template <typename KV>
__device__ __forceinline__ constexpr int split_steps() {
	return sizeof(KV) == 4 ? 2 : SPLIT_STEPS;
}
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
	// A pass takes SPLIT_STEPS positions a lane group (two for an F32
	// cache, whose loads take twice the registers; planAttention's chunks
	// are whole passes, splitPass in attnplan.go): every position's loads are issued, as
	// stored, before the arithmetic, then the pass's scores, their max,
	// one rescaling of the sums, and the values weighed in. Every lane runs
	// every pass (the shuffles need the whole warp); a lane group past p1
	// loads the chunk's last row again and weighs nothing. A quantized
	// block's scale multiplies the 8 values' dot product with q and their
	// weight in the sum of V once (1 for the plain types). The reader
	// makes the dot product (dot8): kv_cache_q8w's in integers, from q
	// rounded to 16 bits by set_query.
	constexpr int U = split_steps<KV>();
	typedef split_reader<KV, D> reader;
	typename reader::type Kr = reader::of(K), Vr = reader::of(V);
	Kr.at_lane(e0);
	Vr.at_lane(e0);
	Kr.set_query(qr);
	typedef decltype(Kr.load8raw(0, 0)) raw;
	for (int base = p0 + warp * PPW; base < p1; base += U * PPB) {
		raw kr[U], vr[U];
		bool ok[U];
#pragma unroll
		for (int u = 0; u < U; u++) {
			const int p = base + u * PPB + sub;
			ok[u] = p < p1;
			kr[u] = Kr.load8raw(min(p, p1 - 1), e0);
			vr[u] = Vr.load8raw(min(p, p1 - 1), e0);
		}
#pragma unroll
		for (int u = 0; u < U; u++) {
			Kr.settle(kr[u]);
			Vr.settle(vr[u]);
		}
		float sc[U];
		float mt = m;
#pragma unroll
		for (int u = 0; u < U; u++) {
			float d = Kr.dot8(kr[u], qr);
#pragma unroll
			for (int o = LPP / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
			sc[u] = ok[u] ? d : -INFINITY;
			mt = fmaxf(mt, sc[u]);
		}
		// mt is -inf only while the group has seen no position (its sums
		// are 0).
		const float corr = mt == -INFINITY ? 1.0f : exp2f(m - mt);
		l *= corr;
#pragma unroll
		for (int i = 0; i < 8; i++) acc[i] *= corr;
#pragma unroll
		for (int u = 0; u < U; u++) {
			const float e = ok[u] ? exp2f(sc[u] - mt) : 0.0f;
			float vf[8];
			Vr.unpack8(vr[u], vf);
			const float ev = e * Vr.scale8(vr[u]);
			l += e;
#pragma unroll
			for (int i = 0; i < 8; i++) acc[i] += ev * vf[i];
		}
		m = mt;
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
// last split block of a head where the splits count themselves; both run
// it with SPLIT_WARPS warps, so they add in the same order. The splits'
// maxima and sums are read once, all at a time, into shared memory, and
// every warp reduces them; warp w then adds the values of splits w,
// w + SPLIT_WARPS, ..., a lane's pairs of each in 8-byte loads, eight
// splits' loads in flight, and the warps' sums meet in shared memory. (A
// thread a value looping over every split, eight loads at a time, was 16
// dependent rounds of loads at 128 splits.) The loads skip L1 (ld.cg),
// which does not see other blocks' writes.
template <int D>
__device__ void merge_splits(float* out, const float* part, int heads, int splits, int h, int t) {
	constexpr int R = D + 2;   // floats a record
	constexpr int J = D / 64;  // pairs of values a lane
	__shared__ float sf[SPLIT_MAX], sl[SPLIT_MAX];
	__shared__ float2 sn[SPLIT_WARPS][D / 2];
	const float* rec = part + ((long long)t * heads + h) * splits * R;
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	for (int s = threadIdx.x; s < splits; s += blockDim.x) {
		sf[s] = __ldcg(rec + s * R);
		sl[s] = __ldcg(rec + s * R + 1);
	}
	__syncthreads();
	float M = -INFINITY;
	for (int s = lane; s < splits; s += 32) M = fmaxf(M, sf[s]);
	M = warp_max(M);
	// A split past query t's positions (max -inf) weighs nothing.
	float den = 0.0f;
	for (int s = lane; s < splits; s += 32) {
		const float f = sf[s] == -INFINITY ? 0.0f : exp2f(sf[s] - M);
		if (f != 0.0f) den += sl[s] * f;
	}
	den = warp_sum(den);
	float2 num[J];
#pragma unroll
	for (int j = 0; j < J; j++) num[j] = make_float2(0.0f, 0.0f);
#pragma unroll 8
	for (int s = warp; s < splits; s += SPLIT_WARPS) {
		const float f = sf[s] == -INFINITY ? 0.0f : exp2f(sf[s] - M);
		const float2* v = (const float2*)(rec + s * R + 2);
#pragma unroll
		for (int j = 0; j < J; j++) {
			const float2 x = __ldcg(v + lane + 32 * j);
			if (f != 0.0f) {
				num[j].x += x.x * f;
				num[j].y += x.y * f;
			}
		}
	}
#pragma unroll
	for (int j = 0; j < J; j++) sn[warp][lane + 32 * j] = num[j];
	__syncthreads();
	for (int d = threadIdx.x; d < D; d += blockDim.x) {
		float n = 0.0f;
#pragma unroll
		for (int w = 0; w < SPLIT_WARPS; w++) n += ((const float*)sn[w])[d];
		out[t * (long long)heads * D + (long long)h * D + d] = n / den;
	}
}

// attention_merge: block (h, t) of SPLIT_WARPS warps merges query t's
// head h (merge_splits), after an attention_split launch without counts.
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
