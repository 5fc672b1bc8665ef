// TokenLogProbs: the readout node omnijev::TokenLogProbs(hidden_rows [M, D], embedding [V, D],
// tokens [M]) -> float32 [M] as a TensorRT IPluginV3 (IPluginV3OneCore/Build/Runtime), following
// the plugin interfaces of TensorRT 10 (docs/engines.md §5) and the arithmetic of docs/contract.md §5.
#pragma once

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace omnijev
{

constexpr char const* kPluginName = "TokenLogProbs";       // the ONNX node's op_type
constexpr char const* kPluginVersion = "1";                // its plugin_version attribute
constexpr char const* kPluginNamespace = "omnijev";        // its domain / plugin_namespace
constexpr int32_t kDefaultChunk = 8192;                    // plugins/readout.py CHUNK

// Per row: logits = hidden_row · embedding_v in float32 (rounded to bfloat16 when the inputs are
// bfloat16, as the reference's BF16 matmul), the running max over vocabulary chunks, a float64 sum
// of exp(logit - max), log p(token) = logit_token - max - log(sum). A token outside [0, V) gives
// NaN (enqueue cannot report it without a host synchronization).
cudaError_t launchTokenLogProbs(void const* hidden, void const* embedding, int64_t const* tokens,
    float* out, int64_t rows, int64_t vocab, int64_t width, int64_t chunk, bool bf16,
    cudaStream_t stream);

class TokenLogProbs : public nvinfer1::IPluginV3,
                      public nvinfer1::IPluginV3OneCore,
                      public nvinfer1::IPluginV3OneBuild,
                      public nvinfer1::IPluginV3OneRuntime
{
public:
    explicit TokenLogProbs(int32_t chunk);
    TokenLogProbs(TokenLogProbs const& other);

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
        int32_t nbInputs, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
        nvinfer1::PluginTensorDesc const* outputDesc, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    void initFields();

    int32_t mChunk;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

class TokenLogProbsCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    TokenLogProbsCreator();

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

} // namespace omnijev

// Entry points TensorRT looks up in a plugin library (IPluginRegistry::loadLibrary, trtexec
// --dynamicPlugins); getPluginCreators is deprecated (docs/engines.md §5.4).
extern "C"
{
    void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
    nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
}
