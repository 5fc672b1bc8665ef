"""Several stills tiled into one numbered panel, as the reference's `mso/panels.py` does
(docs/model.md §8.2): the one image a request of several images becomes, encoded as a JPEG data URL.

docs/model.md §8.2 records the rule: thumbnails of at most 448 px a side; grid 1 -> 1×1, 2 -> 2×1,
up to 4 -> 2×2, else 3 columns; a 6 px border, a 22 px label strip, background (32, 32, 32),
white numerals in Pillow's default font; JPEG quality 88. It does not record where a tile sits
in its cell nor where its numeral is drawn: here every cell is as large as the largest
thumbnail, its label strip above the thumbnail, the thumbnail at the cell's top left and the
numeral 4 px in from the strip's corner (pinned by tests/fixtures/wire/panels.json).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

from runtime import images
from runtime.errors import ContractError

THUMB_SIDE = 448  # §8.2: each image thumbnailed to this largest side
BORDER = 6  # §8.2: px around and between the cells
LABEL = 22  # §8.2: px of label strip above each thumbnail
LABEL_INSET = 4  # px from the strip's top-left corner to its numeral (not recorded in §8.2)
BACKGROUND = (32, 32, 32)  # §8.2
NUMERAL = (255, 255, 255)  # §8.2: white
QUALITY = 88  # §8.2: the panel's JPEG quality
WIDE_COLUMNS = 3  # §8.2: five images and more go three to a row
MAX_IMAGES = 8  # a panel of 8 thumbnails is 1,362 × 1,428 px, about the processor's budget


def columns(count: int) -> int:
    """The grid's columns for `count` images (§8.2): 1 -> 1, 2 -> 2, 3-4 -> 2, else 3."""
    if count == 1:
        return 1
    return 2 if count <= 4 else WIDE_COLUMNS


def thumbnail(url: str) -> Image.Image:
    """One data URL decoded with the contract's checks and limits, as an RGB thumbnail."""
    mime, data, opened = images.open_data_url(url)
    pixels = images.decode_rgb(data, mime, opened)
    image = Image.fromarray(pixels, "RGB")
    image.thumbnail((THUMB_SIDE, THUMB_SIDE))
    return image


def tile(thumbs: Sequence[Image.Image]) -> Image.Image:
    """The numbered panel of these thumbnails, row by row, numbered from 1."""
    cols = columns(len(thumbs))
    rows = -(-len(thumbs) // cols)
    cell_w = max(thumb.width for thumb in thumbs)
    cell_h = LABEL + max(thumb.height for thumb in thumbs)
    size = (cols * cell_w + (cols + 1) * BORDER, rows * cell_h + (rows + 1) * BORDER)
    panel = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(panel)
    font = ImageFont.load_default()
    for index, thumb in enumerate(thumbs):
        x = BORDER + (index % cols) * (cell_w + BORDER)
        y = BORDER + (index // cols) * (cell_h + BORDER)
        draw.text((x + LABEL_INSET, y + LABEL_INSET), str(index + 1), fill=NUMERAL, font=font)
        panel.paste(thumb, (x, y + LABEL))
    return panel


def panel_jpeg(urls: Sequence[str]) -> bytes:
    """The panel of several image data URLs as JPEG bytes (each image decoded in turn)."""
    thumbs = []
    for number, url in enumerate(urls, 1):
        try:
            thumbs.append(thumbnail(url))
        except ContractError as error:
            raise error.within(f"image {number}") from None
    buffer = io.BytesIO()
    tile(thumbs).save(buffer, format="JPEG", quality=QUALITY)
    return buffer.getvalue()


def one_image(urls: Sequence[str]) -> str:
    """The request's one image: a single image untouched (§8.2), several as their panel."""
    if len(urls) == 1:
        return urls[0]
    return "data:image/jpeg;base64," + base64.b64encode(panel_jpeg(urls)).decode("ascii")
