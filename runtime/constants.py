"""Names and numbers the whole project shares: the model id, special token ids, graph names and
the dtype table. Everything else reads them from here (docs/contract.md §2.2, §4.3; docs/engines.md
§1).
"""

from __future__ import annotations

import torch

MODEL_ID = "tinnel123/OmniJev"  # docs/contract.md §2.2: every response names this model
IMAGE_PAD_ID = 248056  # <|image_pad|>, config.json image_token_id (docs/contract.md §4.3)
VISION_START_ID = 248053  # <|vision_start|>
VISION_END_ID = 248054  # <|vision_end|>: the image prefix ends with it
OPEN_ID = 248077  # <|opt|>, added by OmniJev
CLOSE_ID = 248078  # <|/opt|>
OPTION_TOKENS = {"<|opt|>": OPEN_ID, "<|/opt|>": CLOSE_ID}
SPECIAL_IDS = {"<|image_pad|>": IMAGE_PAD_ID, **OPTION_TOKENS}  # the tokenizer's checked ids
VOCABULARY = 248079  # len(tokenizer) with <|opt|>, <|/opt|> (docs/contract.md §4.3)

# The engine graphs (docs/design.md): the vision tower, a language-model pass that returns its
# states, and the readout-only pass (option rows are leaves).
GRAPHS = ("vision", "lm_state", "lm_rows")
# The torch backend's token-packed pass (runtime.packing, runtime.model.packed): every row of a
# request's questions and options end to end in one of a few fixed token counts
PACKED_GRAPH = "lm_packed"

# Token slots of the portable engines' rectangle passes (rows × tokens): runtime.passes plans
# within them. Longer buckets get fewer rows, so that one long question or option does not pay
# for a full pass of its length.
QUESTION_TOKENS = 256  # a question pass: 16 rows × 16, 8 × 32, ...
WIDE_OPTION_TOKENS = 512  # an option pass of the wide family: 64 rows × 8, 32 × 16, 16 × 24, ...
SMALL_OPTION_TOKENS = 256  # an option pass of the small family: 32 rows × 8, 16 × 16, ...
# Image prefixes one language-model pass may read (`prefix_rows` picks each row's): every pass's
# rows continue the rows of one question pass, at most 16 (runtime.config.MAX_QUESTION_BATCH),
# each of one request, so a pass reads at most 16 prefixes. The TensorRT profiles go up to it.
MAX_PREFIXES = 16

# dtype names as the manifests, the command line and the backends write them
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
MODEL_DTYPES = ("float32", "bfloat16")  # what weights may be cast to for export or execution
