#pragma once
// y[i] += a * x[i] on device pointers; returns the cudaError_t as int.
int LaunchAxpy(float a, const float* x, float* y, int n);
