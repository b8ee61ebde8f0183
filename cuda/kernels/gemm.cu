// A plain shared-memory tiled matrix product out[M,N] = x[M,K] . w[N,K]^T
// (F32 x, F32/F16/BF16 w, F32 accumulation). The backend uses it when
// cuBLAS cannot be loaded: correct on every shape, not fast.
#include "common.cuh"

#define TILE 16

// out[M,N] = x[M,K] . w[N,K]^T; block TILE x TILE, grid (ceil(N/TILE), ceil(M/TILE)).
template <typename W>
__device__ void gemm_tiled(float* out, const float* x, const W* w, int M, int N, int K) {
	__shared__ float xs[TILE][TILE + 1], ws[TILE][TILE + 1];
	const int tx = threadIdx.x, ty = threadIdx.y;
	const int row = blockIdx.y * TILE + ty;  // m
	const int col = blockIdx.x * TILE + tx;  // n
	const int wrow = blockIdx.x * TILE + ty; // n of the w tile row this thread loads
	float acc = 0.0f;
	for (int k0 = 0; k0 < K; k0 += TILE) {
		const int k = k0 + tx;
		xs[ty][tx] = (row < M && k < K) ? x[(long long)row * K + k] : 0.0f;
		ws[ty][tx] = (wrow < N && k < K) ? to_f32(w[(long long)wrow * K + k]) : 0.0f;
		__syncthreads();
#pragma unroll
		for (int kk = 0; kk < TILE; kk++) acc += xs[ty][kk] * ws[tx][kk];
		__syncthreads();
	}
	if (row < M && col < N) out[(long long)row * N + col] = acc;
}

extern "C" __global__ void gemm_f32(float* out, const float* x, const float* w, int M, int N, int K) { gemm_tiled(out, x, w, M, N, K); }
extern "C" __global__ void gemm_f16(float* out, const float* x, const __half* w, int M, int N, int K) { gemm_tiled(out, x, w, M, N, K); }
extern "C" __global__ void gemm_bf16(float* out, const float* x, const bf16* w, int M, int N, int K) { gemm_tiled(out, x, w, M, N, K); }
