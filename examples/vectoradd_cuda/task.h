// The vector-add task's interface: the submission defines custom_kernel.
#pragma once

// c[i] = a[i] + b[i] for i < n. `a`, `b` and `c` are device pointers; the function launches
// its kernel(s) on the default stream and returns (the harness synchronizes).
void custom_kernel(const float* a, const float* b, float* c, int n);
