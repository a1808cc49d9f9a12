"""Vision-language models (image + text conversations): the one place that knows a run's model sees images.

A model is a VLM when its config.json has a `vision_config` (LLaVA, Qwen2/2.5-VL, Gemma 3, Idefics3 ...). Its data
is the chat format whose message contents are lists of entries, `{"type": "image", "image": "imgs/0.png"}` (a path
relative to the data file) or `{"type": "text", "text": "..."}`. TRL's vision path is followed: the rows stay
messages + image paths (`images`), and the processor renders, tokenizes and turns images into pixels batch by batch
(ImageCollator), since pixels for a whole dataset would not fit anywhere. Unlike TRL's own collator, the prompt is
masked out of the loss (the conversation is tokenized segment by segment, as core.recipe.data does for text) and so
are the image tokens: the model learns the answers, not to predict image placeholders.

LoRA trains the language model only: the vision tower and its projector stay frozen (lora_targets), unless
model.freeze_vision is false (LoRA then wraps the tower's Linears too, as peft's target_modules match them; a full
fine-tune trains the tower). data.max_pixels sets a Qwen-VL processor's max_pixels (load_processor).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from core.files import read_json_object
from core.recipe import image_column
from core.recipe.data import IGNORE_INDEX, DataError, _as_paths, _chat_segments

# the processor outputs that run along the token sequence (padded with the rows); the rest are the images' own
# tensors (pixel_values, image_grid_thw, image_sizes ...), concatenated image after image
SEQUENCE_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
# module names of a VLM's image side in transformers 5's families (BLIP-2's Q-Former too): LoRA leaves them alone
# fmt: off
VISION_MODULE_NAMES = (
    "visual", "vision_tower", "vision_model", "vision_encoder", "multi_modal_projector", "mm_projector",
    "connector", "merger", "vision_projection", "embed_vision", "image_tower", "video_tower", "aligner",
    "qformer", "language_projection",
)
# fmt: on
VISION_MODULES = "|".join(VISION_MODULE_NAMES)  # as a regex alternation


# a VLM run's own settings (core.recipe.config_keys.IMAGE_SCHEMA): ignored, with a preflight warning, on a text model
IMAGE_KEYS = (
    "data.image_size",
    "data.max_pixels",
    "data.images_per_row",
    "data.pan_and_scan",
    "model.freeze_vision",
)


def is_vlm(model_config) -> bool:
    """A model config (object or config.json's dict) that describes an image encoder beside its language model."""
    if isinstance(model_config, dict):
        return isinstance(model_config.get("vision_config"), dict)
    return getattr(model_config, "vision_config", None) is not None


def folder_is_vlm(path) -> bool:
    """config.json of the model folder `path` says VLM (False when there is none to read)."""
    return is_vlm(read_json_object(Path(path) / "config.json") or {})  # bounded, never a FIFO


def load_processor(path, trust_remote_code: bool = False, max_pixels: int | None = None):
    """The model's processor (image processor + tokenizer + chat template), or DataError in one sentence.
    max_pixels (data.max_pixels): the image processor resizes each image into that many pixels, for the families
    whose processor has the bound (Qwen-VL); the others resize to a fixed size and ignore it."""
    from transformers import AutoProcessor

    from core.fmt import error_line

    try:
        processor = AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    # the library's own error: a property of the folder (or of a missing torchvision: Qwen-VL's video processor)
    except Exception as exc:
        raise DataError(
            f"model.path: {path} is a vision-language model but its processor does not load ({error_line(exc, 200)}): "
            "save the processor next to the weights (processor.save_pretrained)."
        ) from None
    if not hasattr(processor, "image_processor"):
        raise DataError(
            f"model.path: {path} is a vision-language model but has no image processor: save the model's "
            "processor (preprocessor_config.json) next to the weights."
        )
    tok = processor.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding is masked out of the loss anyway
    if max_pixels:
        set_max_pixels(processor.image_processor, max_pixels)
    return processor


def takes_max_pixels(image_processor) -> bool:
    """Qwen-VL's image processors: size {shortest_edge: min_pixels, longest_edge: max_pixels} and a patch merge."""
    size = getattr(image_processor, "size", None)
    return hasattr(image_processor, "merge_size") and size is not None and "longest_edge" in dict(size)


def set_max_pixels(image_processor, max_pixels: int) -> None:
    """The image processor's max_pixels (its size's longest_edge: an area, in Qwen-VL's processors), kept above its
    min_pixels; nothing for a processor without the bound."""
    if not takes_max_pixels(image_processor):
        return
    size = dict(image_processor.size)
    size["longest_edge"] = max(int(max_pixels), int(size.get("shortest_edge") or 0))
    image_processor.size = type(image_processor.size)(**size)
    if hasattr(image_processor, "max_pixels"):  # older processors also keep the bound as an attribute
        image_processor.max_pixels = size["longest_edge"]


def image_size(value) -> tuple[int, int] | None:
    """(width, height) of data.image_size "WxH" (e.g. "1024x768"), or None when it is not one."""
    if not isinstance(value, str):
        return None
    w, sep, h = value.strip().lower().partition("x")
    if not (sep and w.strip().isdigit() and h.strip().isdigit()):
        return None
    w, h = int(w), int(h)
    return (w, h) if w > 0 and h > 0 else None


def model_class():
    """The transformers auto class a VLM loads with (its causal LM head over the language model)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


def lora_targets(lora: dict, freeze_vision: bool = True) -> dict:
    """The lora section with the image side kept out: peft's exclude_modules names the vision tower and projector,
    whatever target_modules says ("all-linear" would otherwise wrap the vision tower's layers too). freeze_vision
    false: as it is, so that target_modules reaches the tower's Linears as well (what the planner counts)."""
    return {**lora, "exclude_modules": rf".*({VISION_MODULES}).*"} if freeze_vision else lora


def freeze_tower(model) -> None:
    """The vision tower and projector frozen (a full fine-tune trains the language model only)."""
    pattern = re.compile(rf"(?:^|\.)(?:{VISION_MODULES})\.")
    for name, param in model.named_parameters():
        if pattern.search(name):
            param.requires_grad_(False)


def quantization(quant, path) -> None:
    """QLoRA on a VLM quantizes its language model only: the frozen vision tower and projector stay in the load
    dtype (4-bit image features lose detail, and bitsandbytes' CPU kernels refuse layers narrower than a block)."""
    if quant is not None and folder_is_vlm(path):
        # transformers matches these from the module name's start
        keep = [rf"(?:.*\.)?(?:{VISION_MODULES})", "lm_head"]
        quant.llm_int8_skip_modules = list(dict.fromkeys([*(quant.llm_int8_skip_modules or []), *keep]))


# ---- the data ------------------------------------------------------------------------------------------------


class ImageChat:
    """The image conversation format: `messages` whose contents are strings or lists of image/text entries; an
    entry naming no file takes the next image of the row's image column (core.recipe.image_column)."""

    def __init__(self, data_cfg: dict):
        paths = _as_paths(data_cfg["path"])
        self.base = paths[0].parent if paths and paths[0].is_file() else (paths[0] if paths else Path.cwd())

    def messages(self, row: dict) -> list[dict] | None:
        """The row's conversation with every image's path resolved, None-valued keys dropped (a JSON loader fills
        the keys one entry lacks with None), or None when it is not a list of {role, content} messages. Column
        images that no entry places go first in the first user turn (TRL's rule for a dataset's images column)."""
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return None
        out = []
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return None
            content = m.get("content")
            if isinstance(content, list):
                entries = []
                for c in content:
                    if not isinstance(c, dict):
                        return None
                    c = {k: v for k, v in c.items() if v is not None}
                    if c.get("type") == "image" or "image" in c:
                        written = image_path(c)
                        c = (
                            {"type": "image", "image": str(self.resolve(written))}
                            if written
                            else {"type": "image"}
                        )
                    entries.append(c)
                content = entries
            elif not isinstance(content, str):
                return None
            out.append({"role": m["role"], "content": content})
        _, column = image_column.row_images(row)
        user = next((m for m in out if m["role"] == "user"), None)
        if column and user is not None and not self.placeholders(out):
            text = user["content"]
            text = [{"type": "text", "text": text}] if isinstance(text, str) else text
            user["content"] = [{"type": "image"} for _ in column] + text
        return out

    def resolve(self, image) -> Path:
        path = Path(str(image or "")).expanduser()
        return path if path.is_absolute() else self.base / path

    def refs(self, row: dict, messages: list[dict]) -> list[tuple[str, object, bool]]:
        """(how a sentence names it, what open_image reads, from the column) for each image the conversation
        places: an entry's file, or the next image of the row's image column; ("", None, False) for an entry
        that gets neither."""
        name, column = image_column.row_images(row)
        written, out, k = ImageChat.raw_images(row), [], 0
        entries = [e for m in messages if isinstance(m["content"], list) for e in m["content"]]
        for i, entry in enumerate(e for e in entries if e.get("type") == "image"):
            if "image" in entry:
                out.append((written[i] if i < len(written) else entry["image"], entry["image"], False))
            elif k < len(column):
                ref = image_column.resolve(column[k], self.base)
                out.append((f"image {k + 1} of the column {name}", ref, True))
                k += 1
            else:
                out.append(("", None, False))
        return out

    @staticmethod
    def images(messages: list[dict]) -> list[str]:
        """The files the conversation's image entries name (column images are not in the messages)."""
        return [
            c["image"]
            for m in messages
            if isinstance(m["content"], list)
            for c in m["content"]
            if c.get("type") == "image" and "image" in c
        ]

    @staticmethod
    def placeholders(messages: list[dict]) -> int:
        return sum(
            c.get("type") == "image" for m in messages if isinstance(m["content"], list) for c in m["content"]
        )

    @staticmethod
    def raw_images(row: dict) -> list[str]:
        """The image entries of a row as the user wrote them (for sentences)."""
        out = []
        for m in row.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            for c in content if isinstance(content, list) else []:
                if isinstance(c, dict) and (c.get("type") == "image" or c.get("image") is not None):
                    out.append(image_path(c))
        return out

    def text_row(self, messages: list[dict]) -> dict:
        """The row as the trainer holds it (TRL's vision dataset: `messages` and `images`)."""
        return {"messages": json.dumps(messages), "images": self.images(messages)}


def image_path(entry: dict) -> str:
    """The file an image entry names: "image" (TRL's and this project's key), or "path" / "url" (transformers'
    chat-template keys) for a local file; "" when it names none."""
    for key in ("image", "path", "url"):
        if isinstance(entry.get(key), str) and entry[key].strip():
            return entry[key]
    return ""


def open_image(ref):
    """The image at the path `ref` (or a column's {"bytes"} / {"path"}: core.recipe.image_column) decoded in RGB;
    OSError/ValueError when it is missing or not a readable image."""
    with image_column.open_ref(ref) as im:
        im.load()  # a truncated file fails here, not at Image.open (which reads the header only)
        return im.convert("RGB")


def image_problem(ref) -> str | None:
    """Why the image (a file, or a column's bytes or path) cannot be used (one clause), or None."""
    gone = image_column.missing(ref)
    if gone:
        return gone
    try:
        open_image(ref)
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError ... for damaged files
        text = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc))  # bytes have no name to say
        return f"cannot be read as an image ({text.splitlines()[0][:120] if text else type(exc).__name__})"
    return None


def _split_images(text: str, token: str, images: list) -> tuple[list, list]:
    """(the images the text places, the rest): one per placeholder, in order."""
    n = text.count(token)
    return images[:n], images[n:]


def encode(
    messages: list[dict], processor, max_length: int | None = None, mask_prompt: bool = True, images=None
) -> dict:
    """One conversation as the model sees it: input_ids, labels and the processor's other outputs (tensors). Each
    segment (core.recipe.data._chat_segments) goes through the processor with the images it places, so that the
    image placeholders are expanded by the processor's own rule; the prompt segments and every image token are
    left out of the loss. images: what the image entries show (placed), when not all of them name a file."""
    import torch

    segments = _chat_segments(messages, processor)
    images = [open_image(p) for p in (ImageChat.images(messages) if images is None else images)]
    token, image_id = processor.image_token, processor.image_token_id
    seq: dict[str, list] = {}
    vision: dict[str, list] = {}
    labels: list[int] = []
    for text, trainable in segments:
        mine, images = _split_images(text, token, images)
        out = processor(text=[text], images=mine or None, return_tensors="pt", add_special_tokens=False)
        for key, value in out.items():
            if key in SEQUENCE_KEYS:
                seq.setdefault(key, []).append(value[0])
            elif mine:
                vision.setdefault(key, []).append(value)
        ids = out["input_ids"][0].tolist()
        keep = trainable or not mask_prompt
        labels += [t if keep and t != image_id else IGNORE_INDEX for t in ids]
    row = {key: torch.cat(parts) for key, parts in seq.items()}
    row["labels"] = torch.tensor(labels, dtype=torch.long)
    row["length"] = len(labels)
    if max_length is not None:
        for key in (*seq, "labels"):
            row[key] = row[key][:max_length]
    row.update({key: image_column.cat_images(parts) for key, parts in vision.items()})
    return row


def token_count(messages: list[dict], processor, images=None) -> tuple[int, int, int]:
    """(tokens, image tokens, the index just past the last image token) of a conversation, without decoding its
    images: the text rendered and tokenized, each image placeholder counted as the processor's rule gives for the
    image's size (read from its header). images: as encode's."""
    text = processor.apply_chat_template(messages, tokenize=False)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    sizes = []
    for ref in ImageChat.images(messages) if images is None else images:
        with image_column.open_ref(ref) as im:
            sizes.append((im.height, im.width))
    per_image = _image_tokens(processor, sizes)
    total, last, k = 0, 0, 0
    for t in ids:
        if t == processor.image_token_id and k < len(per_image):
            total, k = total + per_image[k], k + 1
            last = total
        else:
            total += 1
    return total, sum(per_image), last


def _image_tokens(processor, sizes: list[tuple[int, int]]) -> list[int]:
    if not sizes:
        return []
    rule = getattr(processor, "_get_num_multimodal_tokens", None)
    if rule is not None:
        try:
            return list(rule(image_sizes=[list(s) for s in sizes])["num_image_tokens"])
        except (KeyError, TypeError, NotImplementedError):
            pass
    from PIL import Image  # no published rule: process blank images of those sizes and count the placeholders

    out = []
    for h, w in sizes:
        enc = processor(text=[processor.image_token], images=[Image.new("RGB", (w, h))], return_tensors="pt")
        out.append(int((enc["input_ids"][0] == processor.image_token_id).sum()))
    return out


class ImageCollator:
    """Batches of image conversations, processed on the fly (TRL's vision path): right-padded input_ids, labels
    with the prompt and image tokens at -100, the processor's image tensors concatenated. fill (a smoke test):
    every row filled to max_length, attended to but not trained on, as core.recipe.methods.sft.SmokeCollator does,
    so that the step measured is the longest a run can meet."""

    def __init__(
        self, processor, max_length: int | None, mask_prompt: bool = True, fill: bool = False, base=None
    ):
        self.processor, self.max_length, self.mask_prompt = processor, max_length, mask_prompt
        self.base = base  # the data's folder: relative image paths in a column are relative to it
        self.fill = fill and max_length is not None
        self.pad_token_id = processor.tokenizer.pad_token_id
        self.tokens_seen = 0
        self.samples_seen = 0

    def __call__(self, features: list[dict]) -> dict:
        import torch

        rows = []
        for f in features:  # the images decoded here, batch by batch (a column's bytes or the files)
            messages = json.loads(f["messages"])
            shown = image_column.placed(messages, image_column.values(f.get("images")), self.base)
            rows.append(encode(messages, self.processor, self.max_length, self.mask_prompt, shown))
        width = self.max_length if self.fill else max(len(r["input_ids"]) for r in rows)
        batch: dict = {}
        for key in (*[k for k in SEQUENCE_KEYS if k in rows[0]], "labels"):
            fill = self.pad_token_id if key == "input_ids" else IGNORE_INDEX if key == "labels" else 0
            fill = 1 if key == "attention_mask" and self.fill else fill
            batch[key] = torch.full((len(rows), width), fill, dtype=rows[0][key].dtype)
            for i, r in enumerate(rows):
                batch[key][i, : len(r[key])] = r[key]
        for key in rows[0]:
            if key not in batch and key != "length":
                batch[key] = image_column.cat_images([r[key] for r in rows if key in r])
        self.tokens_seen += sum(len(r["input_ids"]) for r in rows)
        self.samples_seen += len(rows)
        return batch


# ---- the engine's hooks: preflight, datasets, preview, collator ------------------------------------------------


def is_processor(processing_class) -> bool:
    """The run's processing class is a VLM's processor (core.train.preflight.prepare_run makes it one)."""
    return hasattr(processing_class, "image_processor")


def processor_for(model_cfg: dict, processing_class=None, max_pixels: int | None = None):
    return (
        processing_class
        if is_processor(processing_class)
        else load_processor(model_cfg["path"], model_cfg.get("trust_remote_code", False), max_pixels)
    )


def data_images(data_cfg: dict) -> tuple[int, int, int] | None:
    """(width, height, images) of a local image conversation dataset: its largest image by area and the most
    images one row has, read from the files' headers (no pixels decoded); None when the data is not local or has
    no readable image. What the planner assumes when data.image_size / data.images_per_row are not set."""
    paths = _as_paths(data_cfg.get("path") or [])
    try:
        stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in paths)
    except OSError:
        return None  # not a local file (a Hub id, a placeholder): the planner's defaults
    key = json.dumps(
        [stamp, data_cfg.get("columns") or {}, data_cfg.get("split")], sort_keys=True, default=str
    )
    return _data_images(key, json.dumps(data_cfg, sort_keys=True, default=str))


@lru_cache(maxsize=16)
def _data_images(_key: str, data_json: str) -> tuple[int, int, int] | None:
    from core.files import quiet_datasets
    from core.recipe.data import load_rows

    data_cfg = json.loads(data_json)
    try:
        with quiet_datasets():
            ds = load_rows(data_cfg)
    except Exception:  # unreadable data: preflight says why, the plan keeps its defaults
        return None
    fmt, largest, most = ImageChat(data_cfg), None, 0
    for row in ds:
        msgs = fmt.messages(row)
        refs = [ref for _, ref, _ in fmt.refs(row, msgs)] if msgs else []
        most = max(most, len(refs))
        for ref in refs:
            try:
                with image_column.open_ref(ref) as im:
                    size = im.size
            except Exception:  # a missing or broken image: preflight names it
                continue
            if largest is None or size[0] * size[1] > largest[0] * largest[1]:
                largest = size
    return (largest[0], largest[1], most) if largest else None


def collator(processing_class, cfg: dict, smoke: bool = False):
    """The batches of a VLM run (ImageCollator; a smoke test's filled to max_length), None for a text model's."""
    if not is_processor(processing_class):
        return None
    return ImageCollator(
        processing_class,
        cfg["training"]["max_length"],
        cfg["data"]["mask_prompt"],
        fill=smoke,
        base=None if cfg["data"].get("sources") else ImageChat(cfg["data"]).base,  # a mix's files: absolute
    )


def datasets(cfg: dict, ds):
    """(train, eval or None): the rows as TRL's vision path holds them (messages as JSON, image paths). A
    dataset's image column stays the dataset's own (memory-mapped, undecoded) as `images`: only the
    conversations are rewritten, the images are read batch by batch (ImageCollator)."""
    from core.recipe.data import split_eval

    problem = image_column.column_problem(ds)
    if problem:
        raise DataError(problem)
    fmt, name = ImageChat(cfg["data"]), image_column.column(ds)
    if name is None:
        rows = ds.map(
            lambda r: fmt.text_row(fmt.messages(r)), remove_columns=ds.column_names, keep_in_memory=True
        )
        # the files as an undecoded Image column: the rows of a mix with a dataset's image column (data.sources)
        # then have one type
        rows = rows.cast_column("images", image_column.undecoded_list())
    else:
        conversations = [json.dumps(fmt.messages(r)) for r in ds]
        rows = ds.select_columns([name])
        rows = rows if name == "images" else rows.rename_column(name, "images")
        rows = rows.add_column("messages", conversations)
    return split_eval(rows, cfg)
