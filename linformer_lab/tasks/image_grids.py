"""Image grids as PNGs: the tiles of a grid, the paper's completion layout (Fig. 3/4: the prompt
with its bottom occluded, the completion, the original), and a legend naming the grid's columns.
:class:`~linformer_lab.tasks.callbacks.ImageSampleCallback` draws with them during training,
:mod:`linformer_lab.tasks.image_generation` for ``predict``."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["occlude_bottom", "image_grid", "save_png", "completion_triptychs", "COMPLETION_LEGEND", "top_half_rows"]

#: Column titles of a completion grid, in the order of :func:`completion_triptychs`.
COMPLETION_LEGEND = ("prompt (top half)", "generated", "original")

#: Fill value of the occluded (unknown) part of an image: mid grey, so the occluded region is
#: visible on MNIST's black background as well as on colour images.
OCCLUDED_VALUE = 128


def top_half_rows(image_shape: Sequence[int]) -> int:
    """Rows given to a completion: the top half (rounded down) of an image of shape (C, H, W)."""
    return int(image_shape[1]) // 2


def occlude_bottom(images: torch.Tensor, rows: int) -> torch.Tensor:
    """uint8 ``(B, C, H, W)`` -> a copy with every row from ``rows`` down set to grey."""
    occluded = images.clone()
    occluded[:, :, rows:] = OCCLUDED_VALUE
    return occluded


def completion_triptychs(originals: torch.Tensor, completions: torch.Tensor, rows: int) -> torch.Tensor:
    """Interleave ``occluded | completion | original`` per image, the layout of the paper's
    Fig. 3/4 (a)-(c): uint8 ``(B, C, H, W)`` x2 -> ``(3B, C, H, W)``; use 3 columns in a grid."""
    originals = originals.to(completions.device)
    return torch.stack([occlude_bottom(originals, rows), completions, originals], dim=1).flatten(0, 1)


def image_grid(images: torch.Tensor, ncols: int, padding: int = 2, pad_value: int = 255) -> torch.Tensor:
    """uint8 ``(B, C, H, W)`` -> one uint8 ``(C, rows * (H + p) + p, ncols * (W + p) + p)`` image,
    filled row by row; white padding separates the tiles."""
    b, c, h, w = images.shape
    ncols = max(1, min(ncols, b))
    nrows = -(-b // ncols)
    grid = torch.full((c, nrows * (h + padding) + padding, ncols * (w + padding) + padding), pad_value, dtype=torch.uint8)
    for i, image in enumerate(images.cpu()):
        top = padding + (i // ncols) * (h + padding)
        left = padding + (i % ncols) * (w + padding)
        grid[:, top : top + h, left : left + w] = image
    return grid


def save_png(image: torch.Tensor, path: str, scale: int = 1, legend: Sequence[str] | None = None,
             tile_width: int | None = None, padding: int = 2) -> None:
    """Write a uint8 ``(C, H, W)`` image (C = 1 or 3) to ``path``; ``scale`` enlarges small
    images with nearest-neighbour so pixels stay crisp.

    ``legend``: titles of the grid's columns (an :func:`image_grid` of tiles ``tile_width`` wide
    with ``padding``), written in a white band above them; the titles repeat across the grid."""
    array = image.detach().cpu().permute(1, 2, 0).numpy()
    picture = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array, mode="L" if array.shape[2] == 1 else "RGB")
    if scale > 1:
        picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    if legend:
        picture = with_legend(picture, legend, (tile_width or picture.width) * scale, padding * scale)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    picture.save(path)


def with_legend(picture: Image.Image, titles: Sequence[str], tile: int, padding: int) -> Image.Image:
    """``picture`` below a white band naming its columns: tile ``i`` (``tile`` pixels wide after
    ``padding``) is titled ``titles[i % len(titles)]``, centred, in the largest font (8-16 px)
    in which every title fits its tile."""
    columns = max(1, (picture.width - padding) // (tile + padding))
    size = 16
    font = ImageFont.load_default(size=size)
    while size > 8 and max(font.getlength(t) for t in titles) > tile - 2:
        size -= 1
        font = ImageFont.load_default(size=size)
    band = size + 2 * padding + 4
    out = Image.new(picture.mode, (picture.width, picture.height + band), 255 if picture.mode == "L" else (255,) * 3)
    out.paste(picture, (0, band))
    draw = ImageDraw.Draw(out)
    ink = 0 if picture.mode == "L" else (0, 0, 0)
    for column in range(columns):
        title = titles[column % len(titles)]
        while len(title) > 1 and draw.textlength(title, font=font) > tile:
            title = title[:-2] + "…"  # a narrow tile: cut the title rather than overlap the next
        left = padding + column * (tile + padding) + (tile - draw.textlength(title, font=font)) / 2
        draw.text((left, padding + 2), title, fill=ink, font=font)
    return out
