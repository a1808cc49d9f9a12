"""The source side of an export: a local HF model folder, read without loading any tensor data.

Only safetensors checkpoints are accepted: they can be memory-mapped and sliced by rows, which is what keeps
the export's RAM near one tensor. Shapes and dtypes come from the file headers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core.files import BadFile, NotRegularFile, load_json_object, read_safetensors_header
from core.plausible import ImplausibleConfig, check_model_config

# HF architecture -> (llama.cpp architecture name, whether q/k rows get llama.cpp's rotary permutation).
# llama.cpp converts Mistral with its Llama model class, so a Mistral GGUF says "llama" too.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", True),
    "MistralForCausalLM": ("llama", True),
    "Qwen2ForCausalLM": ("qwen2", False),
}
SUPPORTED_ROPE = {None, "default", "linear", "llama3"}
# config.json fields that make a model a mixture of experts (Qwen-MoE, Mixtral / gpt-oss, DeepSeek / GLM)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}


class BadInput(ValueError):
    """Input the export cannot use; its message is one sentence for the user (CLI exit 2)."""


@dataclass
class SourceTensor:
    key: str
    file: Path
    dtype: str  # safetensors code: F32, F16, BF16
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ST_ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass
class Source:
    path: Path
    config: dict
    hf_arch: str
    arch: str
    permute_qk: bool
    tensors: dict[str, SourceTensor] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def n_head(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def n_kv_head(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.n_head)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.config["hidden_size"] // self.n_head)

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    @property
    def rope_parameters(self) -> dict:
        """transformers 5 keeps rope settings in `rope_parameters`; older configs use rope_theta/rope_scaling."""
        rp = dict(self.config.get("rope_parameters") or {})
        scaling = self.config.get("rope_scaling") or {}
        for k, v in scaling.items():
            rp.setdefault(k, v)
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp["type"]
        rp.setdefault("rope_theta", self.config.get("rope_theta", 10000.0))
        return rp

    @property
    def largest_file(self) -> int:
        return max((f.stat().st_size for f in {t.file for t in self.tensors.values()}), default=0)


def _read_header(path: Path) -> dict:
    """The safetensors header of `path` (core.files' one reader); BadInput (one sentence) for anything that is not
    one."""
    fix = "copy or download that file again, or re-save the model with save_pretrained."
    try:
        return read_safetensors_header(path).header
    except BadFile as e:
        raise BadInput(f"{path} {e.why}: {fix}") from None
    except NotRegularFile as e:
        raise BadInput(f"{e}: {fix}") from None
    except OSError as e:
        raise BadInput(f"{path} cannot be read ({e.strerror or e}).") from None


def open_source(model_dir: str | Path) -> Source:
    """Read config.json and the safetensors headers of `model_dir`; BadInput says what is wrong."""
    path = Path(model_dir)
    if not path.is_dir():
        raise BadInput(f"Model folder {path} does not exist.")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise BadInput(f"{path} has no config.json, so it is not a Hugging Face model folder.")
    try:
        config = load_json_object(cfg_file)  # a regular file of sane size
    except BadFile as e:
        raise BadInput(
            f"{cfg_file} {e.why}, so it is not a model config: copy it from the original model."
        ) from None
    try:  # before the vocabulary or any tensor is read: a lying size would allocate gigabytes
        check_model_config(config, str(cfg_file))
    except ImplausibleConfig as exc:
        raise BadInput(str(exc)) from None
    archs = config.get("architectures") or []
    hf_arch = next((a for a in archs if a in ARCHITECTURES), None)
    if hf_arch is None:
        shown = ", ".join(archs) or config.get("model_type", "unknown")
        # llama.cpp's converter knows these families (gguf-py names their architectures): say where to go
        elsewhere = (
            "llama.cpp's own convert_hf_to_gguf.py converts the merged folder of many more: the Qwen-MoE, Mixtral, "
            "gpt-oss, Qwen3.5, Qwen3-Next, Gemma 4, Llama 4, Granite 4.0-H, Nemotron-H, Falcon-H1 and LFM2 families "
            "among them."
        )
        if any(config.get(k) for k in MOE_KEYS):
            raise BadInput(
                f"{shown} is a mixture-of-experts model, which this exporter cannot write to GGUF yet (it writes "
                f"dense Llama, Mistral and Qwen2 models); {elsewhere}"
            )
        raise BadInput(
            f"Architecture {shown} is not supported by this GGUF exporter (it writes dense Llama, Mistral and Qwen2); "
            f"{elsewhere}"
        )
    if config.get("quantization_config"):
        raise BadInput(f"{path} holds a quantized checkpoint; export the unquantized (merged) model instead.")
    arch, permute = ARCHITECTURES[hf_arch]
    src = Source(path=path, config=config, hf_arch=hf_arch, arch=arch, permute_qk=permute)
    rope_type = src.rope_parameters.get("rope_type")
    if rope_type not in SUPPORTED_ROPE:
        raise BadInput(f"RoPE scaling type {rope_type!r} is not supported (supported: none, linear, llama3).")

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({path / f for f in load_json_object(index)["weight_map"].values()})
        except (BadFile, KeyError, TypeError, AttributeError):
            raise BadInput(
                f"{index} is not a safetensors index (JSON with a weight_map of file names); copy or download it "
                "again, or re-save the model with save_pretrained."
            ) from None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise BadInput(f"{path} has only .bin weights; resave it as safetensors (save_pretrained does).")
        raise BadInput(f"{path} has no safetensors weights.")
    for f in files:
        if not f.is_file():
            raise BadInput(f"{f.name} is listed in the index but missing from {path}.")
        for key, info in _read_header(f).items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in ST_ITEMSIZE:
                raise BadInput(
                    f"Tensor {key} is {info['dtype']}; only F32, F16 and BF16 weights can be exported."
                )
            src.tensors[key] = SourceTensor(key, f, info["dtype"], tuple(info["shape"]))
    return src
