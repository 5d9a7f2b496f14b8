// MUFU throughput on the GPU at hand: tanh.approx.f32 vs ex2.approx.ftz.f32 vs both interleaved, 8 independent
// chains per thread, 16 warps per SM. Prints warp-instructions per clock per SM (MUFU peak on sm_90: 0.5, i.e. 16 lanes).
// Build and run: nvcc -arch=sm_90a -O3 -o /tmp/mufu_rate scripts/mufu_rate.cu && /tmp/mufu_rate
#include <cstdio>
#include <cuda_runtime.h>

template <int kOp>
__global__ void mufu_loop(float* out, int iters, long long* cycles) {
  float y[8];
  for (int i = 0; i < 8; ++i) y[i] = 0.001f * (threadIdx.x + i);
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (kOp == 0 || (kOp == 2 && i % 2 == 0)) {
        asm volatile("tanh.approx.f32 %0, %0;" : "+f"(y[i]));
      } else {
        asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(y[i]));
        asm volatile("neg.f32 %0, %0;" : "+f"(y[i]));
      }
    }
  }
  long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += y[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  long long* cyc;
  cudaMalloc(&out, sms * 512 * sizeof(float));
  cudaMalloc(&cyc, sms * sizeof(long long));
  int const iters = 4096, threads = 512;
  char const* names[3] = {"tanh", "ex2(+neg)", "tanh/ex2 mixed"};
  for (int op = 0; op < 3; ++op) {
    for (int rep = 0; rep < 2; ++rep) {
      if (op == 0) mufu_loop<0><<<sms, threads>>>(out, iters, cyc);
      if (op == 1) mufu_loop<1><<<sms, threads>>>(out, iters, cyc);
      if (op == 2) mufu_loop<2><<<sms, threads>>>(out, iters, cyc);
    }
    cudaDeviceSynchronize();
    long long c;
    cudaMemcpy(&c, cyc, sizeof(c), cudaMemcpyDeviceToHost);
    double warp_instr = double(iters) * 8 * threads / 32;
    printf("%-16s %lld cycles, %.3f MUFU warp-instructions per clock per SM\n", names[op], c, warp_instr / c);
  }
  return 0;
}
