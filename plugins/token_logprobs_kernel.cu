// CUDA kernel of omnijev::TokenLogProbs (docs/contract.md §5 arithmetic; plugins/readout.py reference).
// Self-contained (no TensorRT headers) so that it also builds alone for the GPU check.
//
// A block reads kRows hidden rows; warp w owns the vocabulary entries v with v % kWarps == w and
// visits them in increasing order, chunk by chunk. Each logit is a lane-split dot product: lane l
// sums k = l, l+32, ... with fmaf, then a xor butterfly adds the 32 partials (every lane ends
// with the same value). Sweep 1 keeps a running max per row; sweep 2 recomputes each logit (same
// code, same value) and adds exp(logit - max) into a float64 sum per warp; the warps' sums are
// added in warp order. The order therefore depends on kWarps and kLanes alone, not on the chunk
// size, and plugins/kernel_cpu.cpp repeats it on the CPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace omnijev
{
namespace
{

constexpr int kLanes = 32;
constexpr int kWarps = 8;  // = kernel_cpu.cpp kWarps: the float64 sum's order depends on it
constexpr int kRows = 8;   // hidden rows per block: each embedding row read serves kRows rows

__device__ __forceinline__ float load(float const* p, int64_t i)
{
    return __ldg(p + i);
}

__device__ __forceinline__ float load(__nv_bfloat16 const* p, int64_t i)
{
    return __bfloat162float(p[i]);
}

// The logits of `count` rows against embedding row v; every lane returns the same values.
template <typename T>
__device__ void logits(T const* hidden, T const* embedding, int64_t row0, int count, int64_t v,
    int64_t width, bool roundBf16, int lane, float (&out)[kRows])
{
    float partial[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
    {
        partial[r] = 0.0F;
    }
    T const* e = embedding + v * width;
    for (int64_t k = lane; k < width; k += kLanes)
    {
        float const ek = load(e, k);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
        {
            if (r < count)
            {
                partial[r] = fmaf(load(hidden, (row0 + r) * width + k), ek, partial[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r)
    {
        float value = partial[r];
        for (int offset = kLanes / 2; offset > 0; offset /= 2)
        {
            value += __shfl_xor_sync(0xffffffffU, value, offset);
        }
        // the reference's logits come out of a BF16 matmul: round as it does
        out[r] = roundBf16 ? __bfloat162float(__float2bfloat16_rn(value)) : value;
    }
}

template <typename T>
__global__ void __launch_bounds__(kLanes* kWarps) tokenLogProbsKernel(T const* hidden,
    T const* embedding, int64_t const* tokens, float* out, int64_t rows, int64_t vocab,
    int64_t width, int64_t chunk, bool roundBf16)
{
    __shared__ float warpMax[kWarps][kRows];
    __shared__ double warpSum[kWarps][kRows];
    __shared__ float rowMax[kRows];
    __shared__ float tokenLogit[kRows];

    int const lane = threadIdx.x % kLanes;
    int const warp = threadIdx.x / kLanes;
    int64_t const row0 = static_cast<int64_t>(blockIdx.x) * kRows;
    int const count = static_cast<int>(rows - row0 < kRows ? rows - row0 : kRows);
    if (threadIdx.x < kRows)
    {
        tokenLogit[threadIdx.x] = NAN;
    }
    __syncthreads();

    float value[kRows];
    float best[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
    {
        best[r] = -INFINITY;
    }
    for (int64_t start = 0; start < vocab; start += chunk)
    {
        int64_t const end = start + chunk < vocab ? start + chunk : vocab;
        int64_t const first = start + ((warp - start % kWarps) + kWarps) % kWarps;
        for (int64_t v = first; v < end; v += kWarps)
        {
            logits(hidden, embedding, row0, count, v, width, roundBf16, lane, value);
#pragma unroll
            for (int r = 0; r < kRows; ++r)
            {
                best[r] = fmaxf(best[r], value[r]);
                if (lane == 0 && r < count && tokens[row0 + r] == v)
                {
                    tokenLogit[r] = value[r];
                }
            }
        }
    }
    if (lane == 0)
    {
#pragma unroll
        for (int r = 0; r < kRows; ++r)
        {
            warpMax[warp][r] = best[r];
        }
    }
    __syncthreads();
    if (threadIdx.x < kRows)
    {
        float m = warpMax[0][threadIdx.x];
        for (int w = 1; w < kWarps; ++w)
        {
            m = fmaxf(m, warpMax[w][threadIdx.x]);
        }
        rowMax[threadIdx.x] = m;
    }
    __syncthreads();

    double sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
    {
        sum[r] = 0.0;
    }
    for (int64_t start = 0; start < vocab; start += chunk)
    {
        int64_t const end = start + chunk < vocab ? start + chunk : vocab;
        int64_t const first = start + ((warp - start % kWarps) + kWarps) % kWarps;
        for (int64_t v = first; v < end; v += kWarps)
        {
            logits(hidden, embedding, row0, count, v, width, roundBf16, lane, value);
#pragma unroll
            for (int r = 0; r < kRows; ++r)
            {
                sum[r] += static_cast<double>(expf(value[r] - rowMax[r]));
            }
        }
    }
    if (lane == 0)
    {
#pragma unroll
        for (int r = 0; r < kRows; ++r)
        {
            warpSum[warp][r] = sum[r];
        }
    }
    __syncthreads();
    if (threadIdx.x < count)
    {
        int const r = threadIdx.x;
        double total = warpSum[0][r];
        for (int w = 1; w < kWarps; ++w)
        {
            total += warpSum[w][r];
        }
        float const shifted = tokenLogit[r] - rowMax[r];
        out[row0 + r] = static_cast<float>(static_cast<double>(shifted) - log(total));
    }
}

} // namespace

cudaError_t launchTokenLogProbs(void const* hidden, void const* embedding, int64_t const* tokens,
    float* out, int64_t rows, int64_t vocab, int64_t width, int64_t chunk, bool bf16,
    cudaStream_t stream)
{
    if (rows <= 0)
    {
        return cudaSuccess;
    }
    if (vocab <= 0 || width <= 0 || chunk <= 0)
    {
        return cudaErrorInvalidValue;
    }
    dim3 const grid(static_cast<unsigned>((rows + kRows - 1) / kRows));
    dim3 const block(kLanes * kWarps);
    if (bf16)
    {
        tokenLogProbsKernel<__nv_bfloat16><<<grid, block, 0, stream>>>(
            static_cast<__nv_bfloat16 const*>(hidden), static_cast<__nv_bfloat16 const*>(embedding),
            tokens, out, rows, vocab, width, chunk, true);
    }
    else
    {
        tokenLogProbsKernel<float><<<grid, block, 0, stream>>>(static_cast<float const*>(hidden),
            static_cast<float const*>(embedding), tokens, out, rows, vocab, width, chunk, false);
    }
    return cudaPeekAtLastError();
}

} // namespace omnijev

// Plain C entry for the GPU check (tests/test_plugin_cpu.py loads it with ctypes).
extern "C" int omnijev_token_logprobs_cuda(void const* hidden, void const* embedding,
    int64_t const* tokens, float* out, int64_t rows, int64_t vocab, int64_t width, int64_t chunk,
    int32_t bf16, void* stream)
{
    cudaError_t const status = omnijev::launchTokenLogProbs(hidden, embedding, tokens, out, rows,
        vocab, width, chunk, bf16 != 0, static_cast<cudaStream_t>(stream));
    return status == cudaSuccess ? 0 : static_cast<int>(status);
}
