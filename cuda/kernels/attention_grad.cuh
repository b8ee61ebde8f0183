// The backward of causal grouped-query attention over T positions from 0
// (kernels/attention.cu's forward with pos0 = 0): score(t,s) = (scale*q[t,h])
// . k[s,g] for s <= t, p = softmax_s(score), out[t,h] = sum_s p v[s,g], with
// g = h / (heads/kvHeads). With D[t,h] = dout[t,h] . out[t,h] and
// dp(t,s) = dout[t,h] . v[s,g]:
//   dq[t,h] = scale * sum_s p (dp - D) k[s,g]
//   dk[s,g] = scale * sum_{h in g, t >= s} p (dp - D) q[t,h]
//   dv[s,g] = sum_{h in g, t >= s} p dout[t,h]
// Nothing of size T^2 is stored: attention_grad_q recomputes p with an
// online softmax and writes the log-sum-exp and D per (t,h);
// attention_grad_kv recomputes p from them.
//
// Both kernels give each warp one row (a query row in _q, a key row in _kv)
// and stage tiles of AG_TILE rows of the other side in shared memory, one
// row per lane: lane j computes the full dot products of its tile row with
// the warp's row, and then the warp accumulates the tile's rows weighted by
// those results, lane l holding dimensions l, l+32, ... (up to 32*PER, a
// template parameter; at most 256). Tile rows are padded to an odd stride so that both the
// row-per-lane and the dimension-per-lane reads are free of bank conflicts.
//
// Dynamic shared memory: 2*AG_TILE*stride floats of tiles, 2*headDim
// floats per warp for the warp's own rows, and 2*AG_TILE floats (_kv only).

#pragma once

#include "common.cuh"

// dot2 sets s = a.x and u = b.y over n elements, each with four partial
// sums (of the elements d mod 4) added pairwise at the end: more FMAs in
// flight than with one running sum, and a third of its rounding error,
// which matters because a score's absolute error becomes the relative
// error of its probability. Both kernels compute their scores with it, so
// that they agree bit for bit.
__device__ __forceinline__ void dot2(const float* a, const float* x, const float* b, const float* y, int n, float& s, float& u) {
	float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f, u0 = 0.0f, u1 = 0.0f, u2 = 0.0f, u3 = 0.0f;
	int d = 0;
#pragma unroll 2
	for (; d + 4 <= n; d += 4) {
		s0 += a[d] * x[d];
		s1 += a[d + 1] * x[d + 1];
		s2 += a[d + 2] * x[d + 2];
		s3 += a[d + 3] * x[d + 3];
		u0 += b[d] * y[d];
		u1 += b[d + 1] * y[d + 1];
		u2 += b[d + 2] * y[d + 2];
		u3 += b[d + 3] * y[d + 3];
	}
	if (d < n) {
		s0 += a[d] * x[d];
		u0 += b[d] * y[d];
	}
	if (d + 1 < n) {
		s1 += a[d + 1] * x[d + 1];
		u1 += b[d + 1] * y[d + 1];
	}
	if (d + 2 < n) {
		s2 += a[d + 2] * x[d + 2];
		u2 += b[d + 2] * y[d + 2];
	}
	s = (s0 + s1) + (s2 + s3);
	u = (u0 + u1) + (u2 + u3);
}

#define AG_WARPS 8
#define AG_TILE 32

// Grid (ceil(T/AG_WARPS), heads), block 32*AG_WARPS. Warp w of block b
// takes query row t = (gridDim.x-1-b)*AG_WARPS + w (the longest rows first)
// of head blockIdx.y; dq is set, lse and dd ([T*heads], index t*heads+h)
// receive the row's log-sum-exp and D.
template <int PER>
__device__ void attention_grad_q(float* dq, float* lse, float* dd, const float* dout, const float* q, const float* k, const float* v,
				 const float* out, int T, int heads, int kvHeads, int headDim, float scale) {
	extern __shared__ float smem[];
	const int stride = headDim | 1;
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int h = blockIdx.y, g = h / (heads / kvHeads);
	const int t0 = (gridDim.x - 1 - blockIdx.x) * AG_WARPS;
	const int t = t0 + warp;
	const bool active = t < T;
	const long long qStride = (long long)heads * headDim, kvStride = (long long)kvHeads * headDim;
	float* ks = smem;
	float* vs = ks + AG_TILE * stride;
	float* qs = vs + AG_TILE * stride + warp * 2 * headDim;  // this warp's q*scale
	float* dos = qs + headDim;                               // and dout

	float dsum = 0.0f;
	if (active) {
		const long long o = t * qStride + (long long)h * headDim;
		for (int d = lane; d < headDim; d += 32) {
			const float gd = dout[o + d];
			qs[d] = q[o + d] * scale;
			dos[d] = gd;
			dsum += gd * out[o + d];
		}
	}
	dsum = warp_sum(dsum);  // D[t,h]
	__syncwarp();

	float acc[PER];
#pragma unroll
	for (int i = 0; i < PER; i++) acc[i] = 0.0f;
	float m = -INFINITY, l = 0.0f;  // running max (uniform over the warp) and this lane's part of the sum
	const int tLast = min(t0 + AG_WARPS, T) - 1;
	const float* kb = k + (long long)g * headDim;
	const float* vb = v + (long long)g * headDim;
	for (int s0 = 0; s0 <= tLast; s0 += AG_TILE) {
		__syncthreads();  // the previous tile has been read
		for (int r = warp; r < AG_TILE; r += AG_WARPS) {
			const int s = s0 + r;
			for (int d = lane; d < headDim; d += 32) {
				ks[r * stride + d] = s < T ? kb[s * kvStride + d] : 0.0f;
				vs[r * stride + d] = s < T ? vb[s * kvStride + d] : 0.0f;
			}
		}
		__syncthreads();
		if (!active || s0 > t) continue;  // uniform over the warp
		const int s = s0 + lane;
		const bool valid = s <= t;
		const float* kr = ks + lane * stride;
		const float* vr = vs + lane * stride;
		float sc, dp;
		dot2(qs, kr, dos, vr, headDim, sc, dp);
		sc = valid ? sc : -INFINITY;
		const float mnew = fmaxf(m, warp_max(sc));
		const float corr = expf(m - mnew);  // 0 on the first tile (m = -inf)
		const float e = valid ? expf(sc - mnew) : 0.0f;
		l = l * corr + e;
		const float ds = e * (dp - dsum);
#pragma unroll
		for (int i = 0; i < PER; i++) acc[i] *= corr;
		const int n = min(AG_TILE, t - s0 + 1);
		for (int j = 0; j < n; j++) {
			const float wj = __shfl_sync(0xffffffffu, ds, j);
			const float* kj = ks + j * stride;
#pragma unroll
			for (int i = 0; i < PER; i++) {
				const int d = lane + 32 * i;
				if (d < headDim) acc[i] += wj * kj[d];
			}
		}
		m = mnew;
	}
	if (!active) return;
	const float lsum = warp_sum(l);
	const float f = scale / lsum;
	float* dqr = dq + t * qStride + (long long)h * headDim;
#pragma unroll
	for (int i = 0; i < PER; i++) {
		const int d = lane + 32 * i;
		if (d < headDim) dqr[d] = acc[i] * f;
	}
	if (lane == 0) {
		lse[(long long)t * heads + h] = m + logf(lsum);
		dd[(long long)t * heads + h] = dsum;
	}
}

// Grid (ceil(T/AG_WARPS), kvHeads), block 32*AG_WARPS. Warp w of block b
// takes key row s = b*AG_WARPS + w of KV head blockIdx.y and walks the
// query rows t >= s of every query head of its group in tiles; dk and dv
// are set.
template <int PER>
__device__ void attention_grad_kv(float* dk, float* dv, const float* lse, const float* dd, const float* dout, const float* q, const float* k,
				  const float* v, int T, int heads, int kvHeads, int headDim, float scale) {
	extern __shared__ float smem[];
	const int stride = headDim | 1;
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int g = blockIdx.y, group = heads / kvHeads;
	const int sb = blockIdx.x * AG_WARPS;
	const int s = sb + warp;
	const bool active = s < T;
	const long long qStride = (long long)heads * headDim, kvStride = (long long)kvHeads * headDim;
	float* qs = smem;                        // q*scale of the tile's query rows
	float* dos = qs + AG_TILE * stride;      // dout of the tile's query rows
	float* ls = dos + AG_TILE * stride;      // their log-sum-exp
	float* dsh = ls + AG_TILE;               // their D
	float* kr = dsh + AG_TILE + warp * 2 * headDim;  // this warp's k row
	float* vr = kr + headDim;                        // and v row

	if (active) {
		const long long o = s * kvStride + (long long)g * headDim;
		for (int d = lane; d < headDim; d += 32) {
			kr[d] = k[o + d];
			vr[d] = v[o + d];
		}
	}
	__syncwarp();
	float dka[PER], dva[PER];
#pragma unroll
	for (int i = 0; i < PER; i++) dka[i] = dva[i] = 0.0f;
	for (int hh = 0; hh < group; hh++) {
		const int h = g * group + hh;
		for (int t0 = sb; t0 < T; t0 += AG_TILE) {
			__syncthreads();  // the previous tile has been read
			for (int r = warp; r < AG_TILE; r += AG_WARPS) {
				const int t = t0 + r;
				const long long o = t * qStride + (long long)h * headDim;
				for (int d = lane; d < headDim; d += 32) {
					qs[r * stride + d] = t < T ? q[o + d] * scale : 0.0f;
					dos[r * stride + d] = t < T ? dout[o + d] : 0.0f;
				}
			}
			if (threadIdx.x < AG_TILE) {
				const int t = t0 + threadIdx.x;
				ls[threadIdx.x] = t < T ? lse[(long long)t * heads + h] : 0.0f;
				dsh[threadIdx.x] = t < T ? dd[(long long)t * heads + h] : 0.0f;
			}
			__syncthreads();
			if (!active) continue;
			const int t = t0 + lane;
			const bool valid = t >= s && t < T;
			const float* qr = qs + lane * stride;
			const float* dr = dos + lane * stride;
			float sc, dp;
			dot2(qr, kr, dr, vr, headDim, sc, dp);
			const float p = valid ? expf(sc - ls[lane]) : 0.0f;
			const float w = p * (dp - dsh[lane]);
			const int j0 = max(0, s - t0), j1 = min(AG_TILE, T - t0);  // uniform over the warp
			for (int j = j0; j < j1; j++) {
				const float pj = __shfl_sync(0xffffffffu, p, j);
				const float wj = __shfl_sync(0xffffffffu, w, j);
				const float* qj = qs + j * stride;
				const float* dj = dos + j * stride;
#pragma unroll
				for (int i = 0; i < PER; i++) {
					const int d = lane + 32 * i;
					if (d < headDim) {
						dva[i] += pj * dj[d];
						dka[i] += wj * qj[d];
					}
				}
			}
		}
	}
	if (!active) return;
	const long long o = s * kvStride + (long long)g * headDim;
#pragma unroll
	for (int i = 0; i < PER; i++) {
		const int d = lane + 32 * i;
		if (d < headDim) {
			dk[o + d] = dka[i];
			dv[o + d] = dva[i];
		}
	}
}

// AG_INSTANCE defines the kernels attention_grad_q_f32_dD and
// attention_grad_kv_f32_dD for head dimensions up to D = 32*PER. The
// accumulators of dimensions beyond headDim still cost issue slots, so a
// small head dimension gets an instance with fewer; attention_grad_d*.cu
// instantiate D = 64, 128 and 256, one per file.
#define AG_INSTANCE(D, PER)                                                                                                                 \
	extern "C" __global__ void attention_grad_q_f32_d##D(float* dq, float* lse, float* dd, const float* dout, const float* q, const float* k, \
							     const float* v, const float* out, int T, int heads, int kvHeads, int headDim,      \
							     float scale) {                                                                     \
		attention_grad_q<PER>(dq, lse, dd, dout, q, k, v, out, T, heads, kvHeads, headDim, scale);                                  \
	}                                                                                                                                   \
	extern "C" __global__ void attention_grad_kv_f32_d##D(float* dk, float* dv, const float* lse, const float* dd, const float* dout,          \
							      const float* q, const float* k, const float* v, int T, int heads, int kvHeads,    \
							      int headDim, float scale) {                                                       \
		attention_grad_kv<PER>(dk, dv, lse, dd, dout, q, k, v, T, heads, kvHeads, headDim, scale);                                  \
	}
