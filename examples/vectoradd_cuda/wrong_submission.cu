//!POPCORN leaderboard vectoradd_cuda
// A wrong submission: the grid is computed with truncating division, so the tail of any
// vector whose length is not a multiple of 256 is never written.
#include "task.h"

__global__ void add(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

void custom_kernel(const float* a, const float* b, float* c, int n) {
    int threads = 256;
    int blocks = n / threads;
    if (blocks > 0) add<<<blocks, threads>>>(a, b, c, n);
}
