// The arithmetic of token_logprobs_kernel.cu in plain C++, for a CPU check against
// plugins/readout.py token_logprobs_reference (built with g++ by tests/test_plugin_cpu.py).
//
// It repeats the kernel's order of operations: lane-split fmaf dot products joined by a xor
// butterfly, bfloat16 rounding of logits for bfloat16 inputs, a running max over vocabulary
// chunks, per-warp float64 sums of expf(logit - max) over v % kWarps == w in increasing v, and the
// warps' sums added in warp order. Inputs arrive as float32 (bfloat16 values widen exactly).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace
{

constexpr int kLanes = 32;  // = token_logprobs_kernel.cu kLanes
constexpr int kWarps = 8;   // = token_logprobs_kernel.cu kWarps

float roundToBf16(float value)
{
    if (std::isnan(value))
    {
        return value;
    }
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    bits += 0x7FFFU + ((bits >> 16) & 1U);  // round to nearest, ties to even (__float2bfloat16_rn)
    bits &= 0xFFFF0000U;
    float rounded = 0.0F;
    std::memcpy(&rounded, &bits, sizeof(rounded));
    return rounded;
}

float logit(float const* hidden, float const* embedding, int64_t v, int64_t width, bool bf16)
{
    float partial[kLanes];
    for (int lane = 0; lane < kLanes; ++lane)
    {
        partial[lane] = 0.0F;
        for (int64_t k = lane; k < width; k += kLanes)
        {
            partial[lane] = std::fmaf(hidden[k], embedding[v * width + k], partial[lane]);
        }
    }
    for (int offset = kLanes / 2; offset > 0; offset /= 2)
    {
        float next[kLanes];
        for (int lane = 0; lane < kLanes; ++lane)
        {
            next[lane] = partial[lane] + partial[lane ^ offset];
        }
        std::memcpy(partial, next, sizeof(partial));
    }
    return bf16 ? roundToBf16(partial[0]) : partial[0];
}

// Calls visit(v, warp) for every vocabulary entry in the order each warp sees them.
template <typename Visit>
void sweep(int64_t vocab, int64_t chunk, Visit visit)
{
    for (int warp = 0; warp < kWarps; ++warp)
    {
        for (int64_t start = 0; start < vocab; start += chunk)
        {
            int64_t const end = start + chunk < vocab ? start + chunk : vocab;
            int64_t const first = start + ((warp - start % kWarps) + kWarps) % kWarps;
            for (int64_t v = first; v < end; v += kWarps)
            {
                visit(v, warp);
            }
        }
    }
}

float rowLogProb(float const* hidden, float const* embedding, int64_t token, int64_t vocab,
    int64_t width, int64_t chunk, bool bf16)
{
    float best = -std::numeric_limits<float>::infinity();
    float tokenLogit = std::numeric_limits<float>::quiet_NaN();
    sweep(vocab, chunk, [&](int64_t v, int) {
        float const value = logit(hidden, embedding, v, width, bf16);
        best = std::fmax(best, value);
        if (v == token)
        {
            tokenLogit = value;
        }
    });
    std::vector<double> sums(kWarps, 0.0);
    sweep(vocab, chunk, [&](int64_t v, int warp) {
        float const value = logit(hidden, embedding, v, width, bf16);
        sums[warp] += static_cast<double>(std::exp(value - best));
    });
    double total = sums[0];
    for (int warp = 1; warp < kWarps; ++warp)
    {
        total += sums[warp];
    }
    float const shifted = tokenLogit - best;
    return static_cast<float>(static_cast<double>(shifted) - std::log(total));
}

} // namespace

// hidden [rows, width], embedding [vocab, width] float32; tokens [rows] int64; out [rows].
// Returns 0, or -1 for a bad size; a token outside [0, vocab) gives NaN, as on the GPU.
extern "C" int omnijev_token_logprobs_cpu(float const* hidden, float const* embedding,
    int64_t const* tokens, int64_t rows, int64_t vocab, int64_t width, int64_t chunk, int32_t bf16,
    float* out)
{
    if (rows < 0 || vocab <= 0 || width <= 0 || chunk <= 0)
    {
        return -1;
    }
    for (int64_t r = 0; r < rows; ++r)
    {
        out[r] = rowLogProb(hidden + r * width, embedding, tokens[r], vocab, width, chunk, bf16 != 0);
    }
    return 0;
}
