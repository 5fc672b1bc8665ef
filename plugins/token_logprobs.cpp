// The TokenLogProbs IPluginV3 and its creator (TensorRT 10 plugin interfaces, docs/engines.md §5);
// the arithmetic lives in token_logprobs_kernel.cu.
#include "token_logprobs.h"

#include <cstring>
#include <exception>
#include <mutex>

using namespace nvinfer1;

namespace omnijev
{
namespace
{

constexpr char const* kChunkField = "chunk";
constexpr int32_t kInputs = 3;   // hidden_rows, embedding, tokens
constexpr int32_t kOutputs = 1;  // log-probabilities

ILogger* gLogger{nullptr};

void logError(char const* message) noexcept
{
    if (gLogger != nullptr)
    {
        gLogger->log(ILogger::Severity::kERROR, message);
    }
}

int32_t readChunk(PluginFieldCollection const* fc)
{
    int32_t chunk = kDefaultChunk;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        PluginField const& field = fc->fields[i];
        if (std::strcmp(field.name, kChunkField) != 0 || field.data == nullptr)
        {
            continue;  // plugin_namespace and plugin_version arrive as fields too
        }
        if (field.type == PluginFieldType::kINT64)
        {
            chunk = static_cast<int32_t>(*static_cast<int64_t const*>(field.data));
        }
        else if (field.type == PluginFieldType::kINT32)
        {
            chunk = *static_cast<int32_t const*>(field.data);
        }
    }
    return chunk;
}

} // namespace

TokenLogProbs::TokenLogProbs(int32_t chunk)
    : mChunk(chunk)
{
    initFields();
}

TokenLogProbs::TokenLogProbs(TokenLogProbs const& other)
    : mChunk(other.mChunk)
{
    initFields();  // the field pointers must point at this copy's members
}

void TokenLogProbs::initFields()
{
    mFields.clear();
    mFields.emplace_back(kChunkField, &mChunk, PluginFieldType::kINT32, 1);
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

IPluginCapability* TokenLogProbs::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    }
    return nullptr;
}

IPluginV3* TokenLogProbs::clone() noexcept
{
    try
    {
        return new TokenLogProbs(*this);
    }
    catch (std::exception const& error)
    {
        logError(error.what());
    }
    return nullptr;
}

char const* TokenLogProbs::getPluginName() const noexcept
{
    return kPluginName;
}

char const* TokenLogProbs::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* TokenLogProbs::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

int32_t TokenLogProbs::getNbOutputs() const noexcept
{
    return kOutputs;
}

int32_t TokenLogProbs::configurePlugin(DynamicPluginTensorDesc const*, int32_t nbInputs,
    DynamicPluginTensorDesc const*, int32_t nbOutputs) noexcept
{
    return nbInputs == kInputs && nbOutputs == kOutputs ? 0 : -1;
}

bool TokenLogProbs::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kInputs || nbOutputs != kOutputs || inOut[pos].desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    DataType const type = inOut[pos].desc.type;
    switch (pos)
    {
    case 0: return type == DataType::kFLOAT || type == DataType::kBF16;
    case 1: return type == inOut[0].desc.type;  // one dtype for both matmul operands
    case 2: return type == DataType::kINT64;
    case 3: return type == DataType::kFLOAT;
    default: return false;
    }
}

int32_t TokenLogProbs::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const*, int32_t nbInputs) const noexcept
{
    if (nbInputs != kInputs || nbOutputs != kOutputs)
    {
        return -1;
    }
    outputTypes[0] = DataType::kFLOAT;
    return 0;
}

int32_t TokenLogProbs::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*,
    int32_t, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder&) noexcept
{
    if (nbInputs != kInputs || nbOutputs != kOutputs || inputs[0].nbDims != 2 || inputs[1].nbDims != 2
        || inputs[2].nbDims != 1)
    {
        return -1;
    }
    outputs[0].nbDims = 1;
    outputs[0].d[0] = inputs[2].d[0];  // one log-probability per token
    return 0;
}

size_t TokenLogProbs::getWorkspaceSize(
    DynamicPluginTensorDesc const*, int32_t, DynamicPluginTensorDesc const*, int32_t) const noexcept
{
    return 0;  // no scratch: the kernel recomputes logits instead of storing M × V of them
}

int32_t TokenLogProbs::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const*, int32_t nbOutputs) noexcept
{
    if (nbInputs != kInputs || nbOutputs != kOutputs || in[0].dims.d[1] != in[1].dims.d[1]
        || in[0].dims.d[0] != in[2].dims.d[0])
    {
        return -1;
    }
    return 0;
}

int32_t TokenLogProbs::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*,
    void const* const* inputs, void* const* outputs, void*, cudaStream_t stream) noexcept
{
    // No allocation, copy or synchronization here: enqueue must be capturable in a CUDA graph.
    int64_t const rows = inputDesc[0].dims.d[0];
    int64_t const width = inputDesc[0].dims.d[1];
    int64_t const vocab = inputDesc[1].dims.d[0];
    bool const bf16 = inputDesc[0].type == DataType::kBF16;
    cudaError_t const status = launchTokenLogProbs(inputs[0], inputs[1],
        static_cast<int64_t const*>(inputs[2]), static_cast<float*>(outputs[0]), rows, vocab,
        width, mChunk, bf16, stream);
    if (status != cudaSuccess)
    {
        logError(cudaGetErrorString(status));
        return -1;
    }
    return 0;
}

IPluginV3* TokenLogProbs::attachToContext(IPluginResourceContext*) noexcept
{
    return clone();
}

PluginFieldCollection const* TokenLogProbs::getFieldsToSerialize() noexcept
{
    return &mFieldCollection;
}

TokenLogProbsCreator::TokenLogProbsCreator()
{
    mFields.emplace_back(kChunkField, nullptr, PluginFieldType::kINT32, 1);
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

char const* TokenLogProbsCreator::getPluginName() const noexcept
{
    return kPluginName;
}

char const* TokenLogProbsCreator::getPluginVersion() const noexcept
{
    return kPluginVersion;
}

char const* TokenLogProbsCreator::getPluginNamespace() const noexcept
{
    return kPluginNamespace;
}

PluginFieldCollection const* TokenLogProbsCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

IPluginV3* TokenLogProbsCreator::createPlugin(
    char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept
{
    try
    {
        int32_t const chunk = readChunk(fc);
        if (chunk <= 0)
        {
            logError("TokenLogProbs: chunk must be positive");
            return nullptr;
        }
        return new TokenLogProbs(chunk);
    }
    catch (std::exception const& error)
    {
        logError(error.what());
    }
    return nullptr;
}

} // namespace omnijev

extern "C" void setLoggerFinder(ILoggerFinder* finder)
{
    if (finder != nullptr && omnijev::gLogger == nullptr)
    {
        omnijev::gLogger = finder->findLogger();
    }
}

extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static omnijev::TokenLogProbsCreator creator;
    static IPluginCreatorInterface* const creators[] = {&creator};
    nbCreators = 1;
    return creators;
}
