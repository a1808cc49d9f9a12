"""How each issue #47 family's image processor resizes, tiles or crops an image (transformers 5.25, restated
without the processor: no torchvision, no image needed); core.estimate.vlm_rules counts the tokens of the result."""

from __future__ import annotations

import math


def glm_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, temporal: int = 2):
    """transformers.models.glm4v.image_processing_pil_glm4v.smart_resize for a still image (num_frames =
    temporal_factor: the image counts twice against max_pixels), as (height, width)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if temporal * h_bar * w_bar > max_pixels:
        beta = math.sqrt((temporal * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif temporal * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (temporal * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pixtral_resize(height: int, width: int, longest: int, cell: int) -> tuple[int, int]:
    """PixtralImageProcessor's get_resize_output_image_size: scaled down (floor) to fit longest x longest, then
    up to whole cells (the processor is given patch x merge as its patch size)."""
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return math.ceil(height / cell) * cell, math.ceil(width / cell) * cell


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """transformers.image_processing_utils.select_best_resolution: the grid resolution that keeps most of the image
    and wastes least."""
    best, most, waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < waste):
            best, most, waste = (h, w), effective, wasted
    return best


def anyres_features(height, width, side, patch, pinpoints, max_crops: int = 0) -> tuple[int, int]:
    """(features of the grid, unpadded, with a newline per row; grid tiles) of LlavaNextProcessor /
    LlavaOnevisionProcessor._get_number_of_features, the base crop's features not included."""
    best_h, best_w = best_resolution(height, width, pinpoints)
    scale_h, scale_w = best_h // side, best_w // side
    grid = side // patch
    cur_h, cur_w = grid * scale_h, grid * scale_w
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= ((cur_h - new_h) // 2) * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= ((cur_w - new_w) // 2) * 2
    features, newlines = cur_h * cur_w, cur_h
    if max_crops:  # OneVision's anyres_max_N: pooled down to about N crops' features
        ratio = math.sqrt(cur_h * cur_w / (max_crops * grid**2))
        if ratio > 1.1:
            features = int(cur_h // ratio) * int(cur_w // ratio)
            newlines = int(cur_h // ratio)
    return features + newlines, scale_h * scale_w


def crop_grid(height: int, width: int, side: int, low: int, high: int) -> tuple[int, int]:
    """GotOcr2ImageProcessor's get_optimal_tiled_canvas: (columns, rows) of low..high tiles whose aspect ratio is
    closest to the image's; a tie goes to more tiles while the image covers over half of them."""
    # the processor's order: columns then rows, stably sorted by the tile count
    grids = sorted(
        [(i, j) for i in range(1, high + 1) for j in range(1, high + 1) if low <= i * j <= high],
        key=lambda g: g[0] * g[1],
    )
    aspect, area = width / height, width * height
    best, diff = (1, 1), float("inf")
    for g in grids:
        d = abs(aspect - g[0] / g[1])
        if d < diff:
            best, diff = g, d
        elif d == diff and area > 0.5 * side * side * g[0] * g[1]:
            best = g
    return best


def chunk_canvas(height: int, width: int, side: int, max_chunks: int, to_max: bool) -> tuple[int, int]:
    """Llama4ImageProcessor's find_supported_resolutions + get_best_fit: (rows, columns) of chunks."""
    by_ratio: dict[float, list] = {}
    for n in range(max_chunks, 0, -1):
        for f in sorted({d for d in range(1, n + 1) if n % d == 0}):
            by_ratio.setdefault(f / (n // f), []).append((f, n // f))
    canvases = [(h * side, w * side) for pairs in by_ratio.values() for h, w in pairs]
    scales = [min(h / height, w / width) for h, w in canvases]
    up = [x for x in scales if x >= 1]
    pick = (max(up) if to_max else min(up)) if up else max(x for x in scales if x < 1)
    chosen = [c for c, x in zip(canvases, scales, strict=True) if x == pick]
    h, w = min(chosen, key=lambda c: c[0] * c[1])  # the first of the smallest, as torch.argmin
    return h // side, w // side


def lfm2_layout(height: int, width: int, s: dict) -> tuple[int, int, int, int]:
    """Lfm2VlImageProcessor._get_split_layout: (rows, columns, resized height, resized width); 1 x 1 unsplit."""
    p, ds = int(s.get("encoder_patch_size") or 16), int(s.get("downsample_factor") or 2)
    low, high = int(s.get("min_image_tokens") or 64), int(s.get("max_image_tokens") or 256)
    f = p * ds
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > high * f * f:
        beta = math.sqrt(height * width / (high * f * f))
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < low * f * f:
        beta = math.sqrt(low * f * f / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    lo_t, hi_t = int(s.get("min_tiles") or 2), int(s.get("max_tiles") or 10)
    big_h, big_w = max(p, round(height / f) * f), max(p, round(width / f) * f)
    large = big_h * big_w > high * f * f * float(s.get("max_pixels_tolerance") or 2.0)
    if not (large and s.get("do_image_splitting", True) and not lo_t == hi_t == 1):
        return 1, 1, h, w
    ratios = sorted(
        set(
            (a, b)
            for n in range(lo_t, hi_t + 1)
            for a in range(1, n + 1)
            for b in range(1, n + 1)
            if lo_t <= a * b <= hi_t
        ),
        key=lambda r: r[0] * r[1],
    )  # the processor's own expression: its set's order breaks ties alike
    tile, best, diff = int(s.get("tile_size") or 512), (1, 1), float("inf")
    for r in ratios:
        d = abs(width / height - r[0] / r[1])
        if d < diff:
            best, diff = r, d
        elif d == diff and width * height > 0.5 * tile * tile * r[0] * r[1]:
            best = r
    return best[1], best[0], h, w


def soft_resize(height: int, width: int, patch: int, budget: int, k: int) -> tuple[int, int]:
    """Gemma4ImageProcessor's get_aspect_ratio_preserving_size, as (height, width)."""
    factor = math.sqrt(budget * patch * patch / (height * width))
    side = k * patch
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    longest = (budget // k**2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    return h, w


def idefics2_resize(height: int, width: int, shortest: int, longest: int) -> tuple[int, int]:
    """Idefics2ImageProcessor's get_resize_output_image_size: the short side to `shortest`, the long one capped at
    `longest` (the aspect ratio kept)."""
    aspect = width / height
    if width >= height and width > longest:
        width, height = longest, int(longest / aspect)
    elif height > width and height > longest:
        height, width = longest, int(longest * aspect)
    height, width = max(height, shortest), max(width, shortest)
    return height, width
