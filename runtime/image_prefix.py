"""The image's part of a request: the vision tower on the device and the image prefix pass, whose
states every question row continues; kept across requests by what they depend on.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import numpy as np
import torch

from runtime.images import CLIP_PREFIX, NORMALIZED, device_image_patches
from runtime.lru import LRU
from runtime.passes import MAX_IMAGE_TOKENS, PREFIX_STEP, Pass, bucket
from runtime.run_passes import PassRunner, State, Stopwatch, padded_prefix, to_device
from runtime.types import PreparedImage, PreparedVideo

# the vision tower's position and rotary tables depend only on the patch grid: kept on the
# device for this many grids (made again, a new size costs the host its taps and rotary tables
# and the device a blend); up to 6 MB each on the 4b, a dozen image sizes' traffic keeps them all
VISION_TABLES = 32


class ImagePrefix:
    """The vision tower and the image prefix of a runner's backend, with the prefix cache (an
    image prefix is ~50 MiB of Gated DeltaNet state plus 32 KiB of K/V per prefix token on the
    4b, docs/model.md §11)."""

    def __init__(self, runner: PassRunner, export_dir: Path, model_config: dict, cached: int):
        self.runner = runner
        self.backend = runner.backend
        self.device = runner.device
        self.model_config = model_config
        self.pos_table = torch.from_numpy(vision_pos_embed(export_dir)).to(self.device)
        self.pixel_table = torch.from_numpy(NORMALIZED).to(self.device)
        # a hit reuses the very tensors the same inputs gave: bit-identical answers either way
        self.cache: LRU[str, tuple[State, State]] = LRU(cached)
        self.tables: LRU[tuple, dict[str, torch.Tensor]] = LRU(VISION_TABLES)

    def states(
        self,
        image: PreparedImage,
        rows: Pass,
        clock: Stopwatch,
        key: str | None = None,
        keys: int = 0,
    ) -> tuple[State, State]:
        """(prefix, after prefix) states of an image and its prefix's pass: from the prefix
        cache, else the vision tower and the prefix pass enqueued (laps "vision", "prefix"),
        the prefix padded to `keys` keys where given (`padded_prefix`) before it is kept.
        `key`: their `prefix_key` where the preparation made it."""
        if self.cache.size == 0:
            key = None
        elif key is None:
            key = prefix_key(image, rows)
        cached = self.cache.get(key) if key is not None else None
        if cached is not None:
            clock.lap("vision")
            clock.lap("prefix")
            return cached
        features = self.vision(image)
        clock.lap("vision")
        prefix, after = self.runner.run_prefix(rows, features)
        states = (padded_prefix(prefix, keys), after) if keys else (prefix, after)
        clock.lap("prefix")
        if key is not None:
            self.cache.put(key, states)
        return states

    def vision(self, image: PreparedImage | PreparedVideo) -> torch.Tensor:
        """The image's rows for the prefix pass, zero rows up to the prefix's bucket: the pass
        takes image rows in order, so the extra rows are never read, and the prefix pass's
        shapes repeat across image sizes. A video's frames each go through the tower alone,
        their rows one after another (each frame is an image input, docs/model.md §8.2)."""
        rows = image.image_tokens
        dtype = self.runner.dtypes["image_features"]
        hidden = self.runner.dims.hidden
        clip = isinstance(image, PreparedVideo)
        features = torch.zeros(
            self.feature_rows(rows, clip), hidden, dtype=dtype, device=self.device
        )
        frames = image.frames if clip else (image,)
        at = 0
        for frame in frames:
            self.vision_into(frame, features[at : at + frame.image_tokens])
            at += frame.image_tokens
        return features

    def vision_into(self, image: PreparedImage, features: torch.Tensor) -> None:
        """The vision tower of one image, its rows written into `features`."""
        feeds = dict(self.vision_tables(tuple(int(x) for x in image.grid_thw)))
        dtypes = self.backend.input_dtypes("vision")
        feeds["pixel_values"] = self.pixel_values(image, dtypes["pixel_values"])
        self.backend.run("vision", feeds, {self.output_name("vision", "image_features"): features})

    def feature_rows(self, rows: int, clip: bool = False) -> int:
        """Rows of the image features the prefix pass takes: the largest image's (a clip's
        longest prefix) where the backend captures a graph per shape (`fixed_prefix_keys`), so
        that the prefix pass has one shape a prefix length, else the image's own rows' bucket."""
        if not self.backend.capabilities.fixed_prefix_keys:
            return bucket(rows, PREFIX_STEP)
        return CLIP_PREFIX if clip else bucket(max(rows, MAX_IMAGE_TOKENS), PREFIX_STEP)

    def pixel_values(self, image: PreparedImage, dtype: torch.dtype) -> torch.Tensor:
        """The vision tower's patches: packed on the host, or made on the device from the uint8
        resized image (`prepare(pack=False)`) or from the decoded one, resized there too
        (`prepare(pack=False, resize=False)`, byte for byte the host's resize)."""
        if image.pixel_values is not None:
            return self.tensor(image.pixel_values, dtype)
        upload = partial(self.tensor, dtype=torch.uint8)
        return device_image_patches(image, upload, self.pixel_table).to(dtype).contiguous()

    def vision_tables(self, grid: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """`pos_embeds`, `cos` and `sin` of one patch grid on the device (an LRU by grid): the
        position table blended there (`blend_taps`, the host's bytes), so that a new image size
        costs the host its taps alone rather than ~20 MB of embeddings made and copied."""
        from runtime.model.vision import blend_taps, position_taps, rotary_tables

        def make() -> dict[str, torch.Tensor]:
            dtypes = self.backend.input_dtypes("vision")
            taps, weights = position_taps(grid, self.model_config)
            index, weight = self.tensor(taps, torch.int64), self.tensor(weights, torch.float32)
            zeros = self.pos_table.new_zeros(index.shape[1], self.pos_table.shape[1])
            pos = blend_taps(self.pos_table, index, weight, zeros)
            tables = {"pos_embeds": pos.to(dtypes["pos_embeds"])}
            for name, table in rotary_tables(grid, self.model_config).items():
                tables[name] = self.tensor(table, dtypes[name])
            return tables

        return self.tables.get_or_make(grid, make)

    def output_name(self, graph: str, wanted: str) -> str:
        names = self.backend.output_names(graph)
        return wanted if wanted in names else names[0]

    def tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(array, self.device, dtype)


def vision_pos_embed(export_dir: Path) -> np.ndarray:
    """The vision tower's position table, which `vision_tables` interpolates."""
    from safetensors import safe_open

    with safe_open(str(export_dir / "vision.safetensors"), framework="pt") as f:
        return f.get_tensor("model.visual.pos_embed.weight").float().numpy()


def prefix_key(image: PreparedImage | PreparedVideo, rows: Pass) -> str:
    """Everything the image prefix depends on: its pass's tokens and positions, and the resized
    uint8 image, which fixes the pixel values (hashing the encoded image's digest where the
    preparation made one is cheaper than the decoded pixels)."""
    digest = hashlib.sha256()
    digest.update(rows.input_ids.tobytes())
    digest.update(rows.positions.tobytes())
    for frame in image.frames if isinstance(image, PreparedVideo) else (image,):
        image_digest(frame, digest)
    return digest.hexdigest()


def image_digest(image: PreparedImage, digest) -> None:
    """Adds what fixes one image's pixel values to `digest`."""
    if image.digest is not None:  # the encoded image's, made while preparing
        digest.update(image.digest)
    else:
        pixels = image.resized if image.resized is not None else image.rgb
        digest.update(np.asarray(pixels.shape, dtype=np.int64).tobytes())
        digest.update(memoryview(np.ascontiguousarray(pixels)).cast("B"))
