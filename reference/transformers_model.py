"""The export as transformers' `Qwen3_5ForConditionalGeneration`: the reference's model.

Follows the reference's `load_model` on an `omnijev-merged/1` export (docs/contract.md §8.3).
"""

from __future__ import annotations

import torch

from runtime.export_format import ExportError, ExportInfo, load_language_state, load_vision_state


def build_transformers_model(
    info: ExportInfo, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """The export as `Qwen3_5ForConditionalGeneration` (248,079 rows, `lm_head` tied), in eval."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import local_torch_dtype

    config = Qwen3_5Config.from_dict(info.config)
    # Sub-models are built by AutoModel.from_config, which follows each sub-config's own dtype.
    for part in (config, config.text_config, config.vision_config):
        part.dtype = dtype
    # Allocate without random init: every parameter is overwritten from the export below.
    with torch.device(device), local_torch_dtype(dtype), no_init_weights():
        model = Qwen3_5ForConditionalGeneration(config)
    state = {f"model.language_model.{k}": v for k, v in load_language_state(info).items()}
    state.update(load_vision_state(info))
    result = model.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if key != "lm_head.weight"]
    if missing or result.unexpected_keys:
        extra = (missing or result.unexpected_keys)[0]
        raise ExportError(f"export weights do not fit Qwen3_5ForConditionalGeneration: {extra}")
    model.lm_head.weight = model.model.language_model.embed_tokens.weight
    wrong = [k for k, v in model.state_dict().items() if v.dtype != dtype or v.is_meta]
    if wrong:
        raise ExportError(f"model tensor {wrong[0]} is not {dtype}")
    return model.eval()
