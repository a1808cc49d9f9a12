"""Images held in a dataset column (a Hub dataset's parquet: datasets' Image feature, bytes or paths), beside the
image files that image conversations name (core.recipe.vision).

A row's `images` column (TRL's name: a list of images) or `image` column (one image) feeds the conversation's
image entries that name no file, `{"type": "image"}`, in order; a conversation that places none gets them at the
start of its first user turn (as TRL does). The rows are loaded undecoded ({"bytes", "path"} per image): nothing
is decoded until a batch needs it, and a broken image is a finding naming its row, not a loader's crash.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

COLUMNS = ("images", "image")  # data.columns {images: YOUR_COLUMN} maps another name onto the first


def _image_like(feature) -> bool | None:
    """True: Image (or a list of them); False: strings (paths); None: anything else."""
    from datasets import Image, LargeList, List, Value

    inner = feature.feature if isinstance(feature, (List, LargeList)) else feature
    if isinstance(inner, Image):
        return True
    if isinstance(inner, Value) and inner.dtype in ("string", "large_string"):
        return False
    return None


def _undecoding(feature):
    """The feature with every Image in it set to decode=False (None when it holds no Image)."""
    from datasets import Image, LargeList, List

    if isinstance(feature, Image):
        return Image(mode=feature.mode, decode=False) if feature.decode else feature
    if isinstance(feature, (List, LargeList)) and isinstance(feature.feature, Image):
        out = copy.copy(feature)
        out.feature = _undecoding(feature.feature)
        return out
    return None


def undecoded(ds):
    """`ds` with its Image columns left undecoded. Only the features change (the arrow data is the same), which
    is what datasets' own cast_column does for such a feature: no row is copied or rewritten, unlike cast()."""
    features = getattr(ds, "features", None) or {}
    changed = {name: _undecoding(f) for name, f in features.items()}
    changed = {name: f for name, f in changed.items() if f is not None and f != features[name]}
    if not changed:
        return ds
    out = copy.deepcopy(ds)  # datasets' tables share their arrow buffers on a deepcopy
    for name, feature in changed.items():
        out._info.features[name] = feature
    return out


def undecoded_list():
    """The feature of a row's images as the trainer holds them: a list of undecoded Images."""
    from datasets import Image, List

    return List(Image(decode=False))


def column(ds) -> str | None:
    """The name of `ds`'s image column (`images`, else `image`), None without one."""
    return next((name for name in COLUMNS if name in ds.column_names), None)


def column_problem(ds, where: str = "data") -> str | None:
    """One sentence when the image column holds something else than images or image paths, else None."""
    name = column(ds)
    if name is None or _image_like(ds.features[name]) is not None:
        return None
    return (
        f"{where}: the column {name} holds {_kind(ds.features[name])}, not images (datasets' Image feature) or "
        "image paths: map the column that holds the images with data.columns {images: YOUR_COLUMN}."
    )


def _kind(feature) -> str:
    dtype = getattr(feature, "dtype", None) or getattr(getattr(feature, "feature", None), "dtype", None)
    return f"{dtype} values" if isinstance(dtype, str) else f"{type(feature).__name__} values"


def values(cell) -> list:
    """A row's image cell as a list: a list of images, one image, or none."""
    if cell is None:
        return []
    return list(cell) if isinstance(cell, (list, tuple)) else [cell]


def row_images(row: dict) -> tuple[str | None, list]:
    """(the row's image column, its images): (None, []) without one."""
    for name in COLUMNS:
        if name in row and row[name] is not None:
            return name, values(row[name])
    return None, []


def resolve(ref, base: Path | None):
    """A column image as something open_image reads: a path string or {"path"} without bytes resolved against the
    data's folder (relative paths are relative to the data file, as in image entries); bytes as they are."""
    if isinstance(ref, dict):
        if ref.get("bytes") is not None or not ref.get("path"):
            return ref
        ref = ref["path"]
    if isinstance(ref, str):
        path = Path(ref).expanduser()
        return str(path if path.is_absolute() or base is None else base / path)
    return ref


def label(ref) -> str:
    """How a sentence names an image: its path, or its bytes."""
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return f"({len(ref['bytes'])} bytes{', ' + ref['path'] if ref.get('path') else ''})"
        return str(ref.get("path") or "")
    return str(ref)


def shown(ref):
    """What a page shows as the image: a file's path, or a column image's bytes."""
    if isinstance(ref, dict):
        return ref["bytes"] if ref.get("bytes") is not None else ref.get("path")
    return ref


def open_ref(ref):
    """A PIL image of a path, of {"bytes"} / {"path"} (datasets' undecoded Image) or a PIL image, unloaded."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return Image.open(io.BytesIO(ref["bytes"]))
        ref = ref.get("path")
    if not isinstance(ref, (str, Path)) or not str(ref):
        raise ValueError("it names no file and holds no bytes")
    return Image.open(ref)


def missing(ref) -> str | None:
    """'does not exist' / 'is not a file' for a path that is not there (bytes: None)."""
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return None
        ref = ref.get("path")
    if not isinstance(ref, (str, Path)) or not str(ref):
        return "holds no bytes and names no file"
    p = Path(ref)
    if not p.is_file():
        return "does not exist" if not p.exists() else "is not a file"
    return None


def placed(messages: list[dict], column: list, base: Path | None = None) -> list:
    """What each image entry of a conversation shows, in order: its file, or the next image of the column."""
    out, k = [], 0
    for m in messages:
        for c in m["content"] if isinstance(m["content"], list) else []:
            if c.get("type") != "image":
                continue
            if "image" in c:
                out.append(c["image"])
            else:
                out.append(resolve(column[k], base) if k < len(column) else None)
                k += 1
    return out


def cat_images(parts: list):
    """The image tensors of several segments or rows as one (torch.cat on dim 0). Any-res processors (LLaVA-NeXT,
    LLaVA-OneVision) give each image (1, tiles, 3, H, W) with its own number of tiles: those are zero-padded to the
    most tiles first, as the processor pads a batch of its own (the model reads each image's tiles from image_sizes)."""
    import torch

    most = max(p.shape[1] for p in parts) if all(p.dim() == 5 for p in parts) else None
    if most is not None:
        parts = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in parts]
    return torch.cat(parts)
