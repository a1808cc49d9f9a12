"""Images held in a dataset's image column (issue #50 item 5): datasets' Image feature in parquet, bytes or paths,
feeding a vision-language run as image files do. A tiny LLaVA trains by `python -m core.train` from a parquet
dataset served by the project's Hub test server (olah on 127.0.0.1, tests/hub_server.py); the Train page previews
its rows with their images; a broken image, a column that is not an image and a truncated parquet are each
refused in one sentence naming the source (and the row), exit 2, no traceback."""

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.cli import REPO
from tests.test_vlm_train import vlm_run_config

HAS_OLAH = subprocess.run([sys.executable, "-c", "import olah"], capture_output=True).returncode == 0
needs_olah = pytest.mark.skipif(
    not HAS_OLAH, reason="olah is not installed (pip install -r requirements.txt)"
)
README = (
    "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: train.parquet\n---\n"
)


def _png(colour, size=(30, 24)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return out.getvalue()


def image_rows(n: int = 16, broken: tuple[int, ...] = (), placeholders: bool = True):
    """n image conversations as a Hub vision dataset holds them: `messages` whose image entries name no file
    ({"type": "image"}, TRL's format) and an `images` column of datasets' Image feature (PNG bytes); the rows in
    `broken` (0-based) hold bytes that are no image. Without placeholders the messages are plain strings."""
    import datasets

    from core.demo.toy import COLOURS

    names, messages, images = list(COLOURS), [], []
    for i in range(n):
        name = names[i % len(names)]
        if placeholders:  # a parquet column has one type: every content a list of entries
            user = [{"type": "image", "text": None}, {"type": "text", "text": "What colour is this?"}]
            answer = [{"type": "text", "text": name}]
        else:
            user, answer = "What colour is this?", name
        messages.append([{"role": "user", "content": user}, {"role": "assistant", "content": answer}])
        data = b"not an image at all" if i in broken else _png(COLOURS[name], (20 + i, 24))
        images.append([{"bytes": data, "path": None}])
    ds = datasets.Dataset.from_dict({"messages": messages, "images": images})
    return ds.cast_column("images", datasets.List(datasets.Image()))


def _parquet(ds, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path))
    return path


def _config(model, data, **training) -> dict:
    return vlm_run_config(model, data, logging_steps=1, **training)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from core.demo.toy import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "base")


# ---- in process: the column's images are the files' images ----------------------------------------------------


def test_a_batch_from_the_image_column_is_the_batch_from_the_same_images_as_files(base, tmp_path):
    """The collator decodes the column's bytes batch by batch; the tensors are those of image files."""
    import datasets

    from core.recipe import vision
    from core.recipe.config import validate_config
    from core.recipe.data import load_rows

    ds = image_rows(4)
    column = validate_config(_config(base, _parquet(ds, tmp_path / "col" / "train.parquet")))
    rows = load_rows(column["data"])
    assert not rows.features["images"].feature.decode  # loaded undecoded: bytes until a batch needs them
    (tmp_path / "files" / "imgs").mkdir(parents=True)
    lines = []
    undecoded = ds.cast_column("images", datasets.List(datasets.Image(decode=False)))
    for i, r in enumerate(undecoded):
        (tmp_path / "files" / "imgs" / f"{i}.png").write_bytes(r["images"][0]["bytes"])
        user = [{"type": "image", "image": f"imgs/{i}.png"}, {"type": "text", "text": "What colour is this?"}]
        lines.append(json.dumps({"messages": [{"role": "user", "content": user}, r["messages"][1]]}))
    (tmp_path / "files" / "data.jsonl").write_text("\n".join(lines) + "\n")
    files = validate_config(_config(base, tmp_path / "files" / "data.jsonl"))
    processor = vision.load_processor(base)
    batches = []
    for cfg in (column, files):
        cfg["data"]["eval_split"] = 0.0
        train, _ = vision.datasets(cfg, load_rows(cfg["data"]))
        batches.append(vision.collator(processor, cfg)([train[i] for i in range(4)]))
    assert set(batches[0]) == set(batches[1]) and "pixel_values" in batches[0]
    for key in batches[0]:
        assert torch.equal(batches[0][key], batches[1][key]), key
    trained = batches[0]["labels"][0][batches[0]["labels"][0] != -100]
    assert processor.tokenizer.decode(trained) == "red</s>"


def test_column_images_without_entries_go_first_in_the_user_turn_and_paths_resolve_beside_the_file(
    base, tmp_path
):
    """Plain-string conversations take the column's images at the start of the first user turn (TRL's rule);
    an Image column holding paths (no bytes) is read relative to the parquet file, as image entries are."""
    import datasets

    from core.recipe import vision, vision_checks
    from core.recipe.config import validate_config
    from core.recipe.data import load_rows

    ds = image_rows(4, placeholders=False)
    (tmp_path / "imgs").mkdir()
    paths = []
    for i, r in enumerate(ds.cast_column("images", datasets.List(datasets.Image(decode=False)))):
        (tmp_path / "imgs" / f"{i}.png").write_bytes(r["images"][0]["bytes"])
        paths.append([{"bytes": None, "path": f"imgs/{i}.png"}])
    ds = ds.remove_columns("images").add_column("picture", paths)  # a name of its own: data.columns maps it
    ds = ds.cast_column("picture", datasets.List(datasets.Image(decode=False)))
    cfg = _config(base, _parquet(ds, tmp_path / "train.parquet"))
    cfg = validate_config({**cfg, "data": {**cfg["data"], "columns": {"images": "picture"}}})
    rows = load_rows(cfg["data"])
    fmt = vision.ImageChat(cfg["data"])
    msgs = fmt.messages(rows[0])
    assert (
        msgs[0]["content"][0] == {"type": "image"} and msgs[0]["content"][1]["text"] == "What colour is this?"
    )
    processor = vision.load_processor(base)
    assert [f.message for f in vision_checks.findings(cfg, rows, processor) if f.level == "error"] == []
    preview = vision_checks.preview(cfg["data"], processor, n=2, length_rows=4, max_length=128)
    assert [r["image_tokens"] for r in preview["rows"]] == [16, 16]
    assert preview["rows"][1]["images"] == [str(tmp_path / "imgs" / "1.png")]


def test_a_broken_image_a_wrong_count_and_a_column_of_numbers_are_named_by_source_and_row(base, tmp_path):
    import datasets

    from core.recipe import vision, vision_checks
    from core.recipe.config import validate_config
    from core.recipe.data import load_rows

    processor = vision.load_processor(base)
    ds = image_rows(6, broken=(2,)).cast_column("images", datasets.List(datasets.Image(decode=False)))
    two = ds[4]["images"] * 2  # row 5 holds two images for its one entry
    ds = ds.map(lambda r, i: {"images": two if i == 4 else r["images"]}, with_indices=True)
    ds = ds.cast_column("images", datasets.List(datasets.Image()))
    cfg = validate_config(_config(base, _parquet(ds, tmp_path / "pics.parquet")))
    errors = [f for f in vision_checks.findings(cfg, load_rows(cfg["data"]), processor) if f.level == "error"]
    assert [f.rows for f in errors] == [[3], [5]], [f.message for f in errors]
    assert errors[0].message.startswith("Row 3 of pics.parquet: image 1 of the column images (19 bytes)")
    assert "cannot be read as an image (cannot identify image file)" in errors[0].message
    assert errors[1].message.startswith("Row 5 of pics.parquet: the column images holds 2 image(s)")

    numbers = datasets.Dataset.from_dict({"messages": image_rows(2)["messages"], "image": [1, 2]})
    cfg = validate_config(_config(base, _parquet(numbers, tmp_path / "numbers.parquet")))
    (error,) = vision_checks.findings(cfg, load_rows(cfg["data"]), processor)
    assert error.message == (
        "data: the column image holds int64 values, not images (datasets' Image feature) or image paths: map "
        "the column that holds the images with data.columns {images: YOUR_COLUMN}."
    )


# ---- through the Hub test server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from tests.hub_server import HubServer

    if not HAS_OLAH:
        pytest.skip("olah is not installed (pip install -r requirements.txt)")
    root = tmp_path_factory.mktemp("hub")
    server = HubServer(root / "server")
    good = _parquet(image_rows(16), root / "good" / "train.parquet")
    server.commit_pics = server.publish("acme/pics", {"README.md": README, "train.parquet": good}, "dataset")
    broken = _parquet(image_rows(8, broken=(2,)), root / "broken" / "train.parquet")
    server.publish("acme/broken", {"README.md": README, "train.parquet": broken}, "dataset")
    cut = good.read_bytes()[: good.stat().st_size // 2]  # a parquet cut short
    server.publish("acme/cut", {"README.md": README, "train.parquet": cut}, "dataset")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hub_run(hub, base, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(_config(base, "acme/pics", max_steps=6)))
    proc = hub.run(["-m", "core.train", str(config), "--run-dir", str(root / "run")], root / "hf")
    return root / "hf", root / "run", proc


@needs_olah
@pytest.mark.slow
def test_a_tiny_vlm_trains_from_a_hub_datasets_image_column(hub, hub_run):
    _, run, proc = hub_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in logged if "loss" in m]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]  # it learns the colours' names from the column's images
    assert any("eval_loss" in m for m in logged)
    assert json.loads((run / "sources.json").read_text())["data"]["commit"] == hub.commit_pics
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


@needs_olah
@pytest.mark.slow
def test_the_train_page_previews_the_hub_datasets_rows_with_their_images(
    hub, base, hub_run, workspace, monkeypatch
):
    """Offline, from the cache the run filled: the preview shows each row's image from the column's bytes, the
    length histogram counts its image tokens, and preflight passes."""
    from streamlit.testing.v1 import AppTest

    home, _, proc = hub_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    at = AppTest.from_file(str(REPO / "pages" / "train.py"), default_timeout=180)
    at.session_state["workspace"] = str(workspace)
    at.session_state["train_config"] = _config(base, "acme/pics", max_steps=2)
    at.run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert any(s.value.startswith("Preflight: no problems") for s in at.success)
    preview = at.dataframe[0].value
    assert preview["completion"].iloc[0].startswith("red")
    images = at.get("image")
    assert len(images) == 5  # one thumbnail per shown row, from the column's bytes
    assert [c for i in images for c in i.captions] == [f"row {n}: 16 image tokens" for n in range(1, 6)]
    assert at.get("vega_lite_chart"), "token length histogram"


@needs_olah
@pytest.mark.slow
@pytest.mark.parametrize(
    ("repo", "expected"),
    [
        (
            "acme/broken",
            "Row 3 of acme/broken: image 1 of the column images (19 bytes) cannot be read as an image",
        ),
        ("acme/cut", "data.path: a data file of the dataset acme/cut @ "),
    ],
)
def test_a_broken_image_or_a_truncated_parquet_on_the_hub_is_refused_in_one_sentence(
    hub, base, tmp_path, repo, expected
):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_config(base, repo, max_steps=1)))
    proc = hub.run(["-m", "core.train", str(config), "--run-dir", str(tmp_path / "run")], tmp_path / "hf")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert any(expected in line for line in errors), proc.stderr[-3000:]


@needs_olah
@pytest.mark.slow
def test_the_tuned_vlm_is_evaluated_on_the_hub_datasets_held_out_image_rows(hub, hub_run):
    """core.eval reads the run's held-out rows at the recorded commit (offline, from the cache) with their column
    images: its answer loss is the trainer's own last eval_loss, the same rows and images."""
    home, run, proc = hub_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = hub.run(["-m", "core.eval", "--run", str(run), "--max-new-tokens", "4"], home, True)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    folder = run / "eval" / "eval-split"
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["images"] == ["image 1 of the row's images column"] for r in rows)
    assert all(r["reference"] in {"red", "green", "blue", "yellow"} for r in rows)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_eval = [m["eval_loss"] for m in logged if "eval_loss" in m][-1]
    tuned = sum(r["tuned_loss_sum"] for r in rows) / sum(r["n_answer_tokens"] for r in rows)
    assert abs(tuned - last_eval) < 1e-3, (tuned, last_eval)


@pytest.mark.slow
def test_a_vlm_trains_on_a_mix_of_image_files_and_a_parquet_image_column(base, tmp_path):
    """data.sources for a VLM: image conversations with files and a parquet's image column, interleaved 1:1;
    both sources' held-out rows are evaluated on their own."""
    from core.demo.toy import build_image_dataset
    from tests.cli import train

    files = build_image_dataset(tmp_path / "files", rows=16)
    column = _parquet(image_rows(16), tmp_path / "column" / "pics.parquet")
    cfg = _config(base, files, max_steps=3)
    cfg["data"] = {"sources": [{"path": str(files), "weight": 1}, {"path": str(column), "weight": 1}]}
    cfg["data"].update(eval_split=0.25, mix={"seed": 3})
    from core.recipe.config import validate_config

    done = train(validate_config(cfg), tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "mix.json").read_text())
    assert [s["source"] for s in record["sources"]] == ["data.jsonl", "pics.parquet"]
    assert all(s["train"] > 0 and s["eval"] > 0 for s in record["sources"]), record
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(any(f"eval_{name}_loss" in m for m in logged) for name in ("data", "pics")), logged[-3:]
    assert all(math.isfinite(m["loss"]) for m in logged if "loss" in m)
