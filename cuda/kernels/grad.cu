// The backward kernels of training (tensor.GradOps in tensor/grad.go):
// RMSNorm, SiLU-times-up, bias, cross-entropy, and tiled fallbacks for the
// two backward matrix products when cuBLAS is not loaded (attention's
// backward is in attention_grad.cuh). Gradients are F32; weight operands
// are F32, F16 or BF16, widened exactly. "+=" kernels add into their
// destination, which the caller zeroes when it wants the plain gradient.
#include "common.cuh"

// block_max returns the maximum of v over the block to every thread, with
// the same constraints as block_sum.
__device__ __forceinline__ float block_max(float v) {
	__shared__ float partial[32];
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	v = warp_max(v);
	__syncthreads();
	if (lane == 0) partial[warp] = v;
	__syncthreads();
	const int nwarps = blockDim.x >> 5;
	v = lane < nwarps ? partial[lane] : -INFINITY;
	return warp_max(v);
}

// ---- RMSNorm ----

// Backward of out = x * r * w, r = rsqrt(mean(x^2) + eps), over rows of n:
// dx += r*dy*w - r^3 * (sum dy*w*x) / n * x, and rs[row] = r for
// rmsnorm_grad_w. One block per row; blockDim.x a multiple of 32.
template <typename W>
__device__ void rmsnorm_grad(float* dx, float* rs, const float* dy, const float* x, const W* w, int n, float eps) {
	const long long row = blockIdx.x;
	const float* xr = x + row * n;
	const float* gr = dy + row * n;
	float* dr = dx + row * n;
	float ss = 0.0f, dot = 0.0f;
	for (int i = threadIdx.x; i < n; i += blockDim.x) {
		const float v = xr[i];
		ss += v * v;
		dot += gr[i] * to_f32(w[i]) * v;
	}
	ss = block_sum(ss);
	dot = block_sum(dot);
	const float r = rsqrtf(ss / (float)n + eps);
	const float c = r * r * r * dot / (float)n;
	for (int i = threadIdx.x; i < n; i += blockDim.x) dr[i] += r * gr[i] * to_f32(w[i]) - c * xr[i];
	if (threadIdx.x == 0) rs[row] = r;
}

extern "C" __global__ void rmsnorm_grad_f32(float* dx, float* rs, const float* dy, const float* x, const float* w, int n, float eps) {
	rmsnorm_grad(dx, rs, dy, x, w, n, eps);
}
extern "C" __global__ void rmsnorm_grad_f16(float* dx, float* rs, const float* dy, const float* x, const __half* w, int n, float eps) {
	rmsnorm_grad(dx, rs, dy, x, w, n, eps);
}
extern "C" __global__ void rmsnorm_grad_bf16(float* dx, float* rs, const float* dy, const float* x, const bf16* w, int n, float eps) {
	rmsnorm_grad(dx, rs, dy, x, w, n, eps);
}

// ---- Column reductions: bias and RMSNorm weight gradients ----

#define COL_ROWS 8  // row groups per block; the block is 32 columns x COL_ROWS

// out[c] += sum over m of a[m,c] (* b[m,c] * r[m] when b is not null).
// Block 32*COL_ROWS threads, grid ceil(N/32): lane = column within the
// block's 32, warp = row group; rows are summed per warp in order, then the
// COL_ROWS partial sums in order, so the result is deterministic.
__device__ __forceinline__ void col_reduce(float* out, const float* a, const float* b, const float* r, long long M, int N) {
	__shared__ float part[COL_ROWS][33];
	const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
	const int c = blockIdx.x * 32 + lane;
	float s = 0.0f;
	if (c < N) {
		for (long long m = grp; m < M; m += COL_ROWS) {
			const long long i = m * N + c;
			s += b ? a[i] * b[i] * r[m] : a[i];
		}
	}
	part[grp][lane] = s;
	__syncthreads();
	if (grp == 0 && c < N) {
		float t = 0.0f;
#pragma unroll
		for (int g = 0; g < COL_ROWS; g++) t += part[g][lane];
		out[c] += t;
	}
}

// db[N] += column sums of dy[M,N].
extern "C" __global__ void bias_grad_f32(float* db, const float* dy, long long M, int N) { col_reduce(db, dy, nullptr, nullptr, M, N); }

// dw[N] += sum over m of dy[m,:] * x[m,:] * rs[m].
extern "C" __global__ void rmsnorm_grad_w_f32(float* dw, const float* dy, const float* x, const float* rs, long long M, int N) {
	col_reduce(dw, dy, x, rs, M, N);
}

// ---- SiLU(gate) * up ----

// dgate = dout * up * sig * (1 + g*(1-sig)), dup = dout * g * sig, with
// sig = sigmoid(g). dgate may be dout: each element is read before it is
// written.
extern "C" __global__ void silu_mul_grad_f32(float* dgate, float* dup, const float* dout, const float* gate, const float* up, long long n) {
	GRID_STRIDE(i, n) {
		const float d = dout[i], g = gate[i], u = up[i];
		const float sig = 1.0f / (1.0f + expf(-g));
		dup[i] = d * (g * sig);
		dgate[i] = d * u * sig * (1.0f + g * (1.0f - sig));
	}
}

// ---- Cross-entropy ----

// One block per row of logits [rows, V]: loss[row] = logsumexp(z) -
// z[target], and z becomes (softmax(z) - onehot(target)) * scale, with the
// maximum subtracted before exp and F32 sums. A negative target zeroes the
// row and its loss. Targets were range-checked on the host.
extern "C" __global__ void cross_entropy_grad_f32(float* logits, float* loss, const int* targets, int V, float scale) {
	const long long row = blockIdx.x;
	float* z = logits + row * V;
	const int y = targets[row];
	if (y < 0) {  // uniform over the block
		for (int i = threadIdx.x; i < V; i += blockDim.x) z[i] = 0.0f;
		if (threadIdx.x == 0) loss[row] = 0.0f;
		return;
	}
	const float zy = z[y];  // read before the reductions' barriers, so before any write
	float mx = -INFINITY;
	for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, z[i]);
	mx = block_max(mx);
	float s = 0.0f;
	for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(z[i] - mx);
	s = block_sum(s);
	const float inv = 1.0f / s;
	for (int i = threadIdx.x; i < V; i += blockDim.x) z[i] = (expf(z[i] - mx) * inv - (i == y ? 1.0f : 0.0f)) * scale;
	// (max - z[y]) + log(sum) rather than logsumexp - z[y]: a small loss
	// keeps its relative precision.
	if (threadIdx.x == 0) loss[row] = (mx - zy) + logf(s);
}

// ---- Tiled matrix products (used when cuBLAS is not loaded) ----

#define GT 16

// dx[M,K] += dy[M,N] . w[N,K], dy with row stride ldy (>= N). Block GT x GT,
// grid (ceil(K/GT), ceil(M/GT)).
template <typename W>
__device__ void grad_x_tiled(float* dx, const float* dy, const W* w, int M, int N, int K, int ldy) {
	__shared__ float ys[GT][GT + 1], ws[GT][GT + 1];
	const int tx = threadIdx.x, ty = threadIdx.y;
	const int row = blockIdx.y * GT + ty;  // m
	const int col = blockIdx.x * GT + tx;  // k
	float acc = 0.0f;
	for (int n0 = 0; n0 < N; n0 += GT) {
		ys[ty][tx] = (row < M && n0 + tx < N) ? dy[(long long)row * ldy + n0 + tx] : 0.0f;
		ws[ty][tx] = (n0 + ty < N && col < K) ? to_f32(w[(long long)(n0 + ty) * K + col]) : 0.0f;
		__syncthreads();
#pragma unroll
		for (int j = 0; j < GT; j++) acc += ys[ty][j] * ws[j][tx];
		__syncthreads();
	}
	if (row < M && col < K) dx[(long long)row * K + col] += acc;
}

extern "C" __global__ void gemm_grad_x_f32(float* dx, const float* dy, const float* w, int M, int N, int K, int ldy) {
	grad_x_tiled(dx, dy, w, M, N, K, ldy);
}
extern "C" __global__ void gemm_grad_x_f16(float* dx, const float* dy, const __half* w, int M, int N, int K, int ldy) {
	grad_x_tiled(dx, dy, w, M, N, K, ldy);
}
extern "C" __global__ void gemm_grad_x_bf16(float* dx, const float* dy, const bf16* w, int M, int N, int K, int ldy) {
	grad_x_tiled(dx, dy, w, M, N, K, ldy);
}

// dw[N,K] += dy[M,N]^T . x[M,K]. Block GT x GT, grid (ceil(K/GT), ceil(N/GT)).
extern "C" __global__ void gemm_grad_w_f32(float* dw, const float* dy, const float* x, int M, int N, int K) {
	__shared__ float ds[GT][GT + 1], xs[GT][GT + 1];
	const int tx = threadIdx.x, ty = threadIdx.y;
	const int n0 = blockIdx.y * GT;
	const int row = n0 + ty;               // n
	const int col = blockIdx.x * GT + tx;  // k
	float acc = 0.0f;
	for (int m0 = 0; m0 < M; m0 += GT) {
		const int m = m0 + ty;
		ds[ty][tx] = (m < M && n0 + tx < N) ? dy[(long long)m * N + n0 + tx] : 0.0f;
		xs[ty][tx] = (m < M && col < K) ? x[(long long)m * K + col] : 0.0f;
		__syncthreads();
#pragma unroll
		for (int j = 0; j < GT; j++) acc += ds[j][ty] * xs[j][tx];
		__syncthreads();
	}
	if (row < N && col < K) dw[(long long)row * K + col] += acc;
}
