"""LoRA on parameters (peft's target_parameters: a mixture-of-experts model's fused experts, a router's weight)
folded into the base checkpoint's own tensors.

peft 0.21 wraps each targeted parameter in a ParamWrapper (nested when a module has several) and saves its pair as
`<module>[.base_layer...].lora_A.weight` (rank x experts rows, one rank-r block per expert) and `lora_B.weight`;
the delta of expert e is scale x B_e A_e, in the parameter's own layout (experts x out x in, or experts x in x out
when the experts class stores them transposed, gpt-oss). transformers 5 fuses the experts when it loads a
checkpoint and writes them back in the checkpoint's layout when it saves: Qwen-MoE-style folders hold one tensor
per expert and projection (`mlp.experts.3.gate_proj.weight`), Mixtral's `block_sparse_moe.experts.3.w1.weight`,
gpt-oss the fused tensors. Its conversion mapping (transformers.conversion_mapping) says how: renamings, and
converters that stack the experts (MergeModulelist, dim 0) and concatenate gate and up (Concatenate, dim 1). The
merge keeps the checkpoint's layout and adds to each of its tensors the rows of the delta that land there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from core.merge.adapter import Adapter, LoraModule, _pattern_value
from core.merge.errors import MergeError


@dataclass
class ParamLora(LoraModule):
    """One wrapped parameter's adapter, and which rows of it one checkpoint tensor holds."""

    param: str = ""  # the model parameter, e.g. model.layers.0.mlp.experts.gate_up_proj
    experts: int = 1
    transposed: bool = False  # stored experts x in x out
    matrix: bool = False  # a 2-D parameter (a router's weight): out x in, one adapter
    expert: int | None = None  # the checkpoint tensor holds this expert alone (None: the whole parameter)
    offset: int = 0  # ... from this row of the expert's (out, in) matrix on (gate, then up)

    def expert_delta(self, e: int) -> torch.Tensor:
        """Expert e's scaled delta in the parameter's layout (fp32)."""
        r = self.A.shape[0] // self.experts
        a = self.A.reshape(self.experts, r, -1)[e]
        b = self.B.reshape(self.B.shape[0], r, self.experts)[:, :, e]
        d = (b @ a) * self.scale
        return d.T if self.transposed else d

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The delta of rows [start, stop) of the checkpoint tensor this piece is attached to."""
        if self.expert is not None:
            return self.expert_delta(self.expert)[self.offset + start : self.offset + stop]
        if self.matrix:
            return (self.B[start:stop] @ self.A) * self.scale
        return torch.stack([self.expert_delta(e) for e in range(start, stop)])


def module_kind(module) -> str:
    """A base layer's kind as the merge treats it (Conv1D, Embedding, Linear), else its class name."""
    from transformers.pytorch_utils import Conv1D  # heavy (transformers): see core.merge.mapping._meta_model

    if isinstance(module, Conv1D):
        return "conv1d"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if isinstance(module, torch.nn.Linear):
        return "linear"
    return type(module).__name__


def split_parameter_modules(adapter: Adapter, modules: dict) -> dict[str, LoraModule]:
    """The adapter's ParamWrapper pairs, taken out of adapter.modules (they are no layer of their own): with
    target_parameters, every pair peft nests (`.base_layer`) or whose module in the base (`modules`, the meta
    model's) is not a Linear, Conv1D or Embedding layer. A layer's pair whose rank disagrees with the config is
    refused here (core.merge.adapter left it for this decision)."""
    if not adapter.config.get("target_parameters"):
        return {}
    out = {}
    for name in list(adapter.modules):
        module = modules.get(_bare(name))
        if name != _bare(name) or (module is not None and module_kind(module) not in LAYERS):
            out[name] = adapter.modules.pop(name)
        elif adapter.modules[name].scale is None:
            raise MergeError(
                f"Adapter module {name}: its tensors' rank disagrees with adapter_config.json (r/rank_pattern): "
                "the config and the weights do not belong together."
            )
    return out


LAYERS = ("linear", "conv1d", "embedding")


def _bare(name: str) -> str:
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    return name


def attach_parameters(targets, adapter: Adapter, pairs: dict[str, LoraModule]) -> None:
    """Attach each pair to the checkpoint tensors holding its parameter (`targets`: core.merge.mapping's _Targets)."""
    layout = _Layout(targets.config.get("model_type"), targets.base.tensors)
    for name, mod in pairs.items():
        if mod.A is None or mod.B is None:
            raise MergeError(
                f"Adapter module {name} has only one of its LoRA A/B matrices: the adapter is incomplete."
            )
        module_name = _bare(name)
        module = targets.modules.get(module_name)
        if module is None:
            raise MergeError(
                f"Adapter module {module_name} does not exist in the base architecture "
                f"({targets.config.get('model_type')}): the adapter belongs to another model."
            )
        param, experts, transposed, matrix = _which_parameter(module_name, module, mod, adapter.config)
        key = f"{module_name}.{param}"
        r = mod.A.shape[0] // experts
        alpha = _pattern_value(
            adapter.config.get("alpha_pattern") or {}, key, adapter.config.get("lora_alpha", 8)
        )
        scale = alpha / (r**0.5) if adapter.config.get("use_rslora") else alpha / r
        pieces = layout.pieces(key)
        if not pieces:
            raise MergeError(
                f"The adapter changes {key}, which no tensor of the base checkpoint {targets.base_dir} holds: the "
                "adapter does not belong to this base model (or its checkpoint uses names this merge cannot map)."
            )
        for ckpt_key, expert, offset in pieces:
            plan = targets.by_key[ckpt_key]
            if plan.lora is not None:
                raise MergeError(f"Two adapter modules map to the same base tensor {plan.out_key}.")
            plan.lora = ParamLora(
                name,
                mod.A,
                mod.B,
                scale=scale,
                kind="param",
                param=key,
                experts=experts,
                transposed=transposed,
                matrix=matrix,
                expert=expert,
                offset=offset,
            )


def _which_parameter(module_name: str, module, mod: LoraModule, config: dict) -> tuple[str, int, bool, bool]:
    """(parameter name, experts, transposed, 2-D) of the module's parameter whose shape this pair's A and B fit."""
    wanted = {p.rsplit(".", 1)[-1] for p in config.get("target_parameters") or []}
    transposed = bool(getattr(module, "is_transposed", False))
    fits = []
    for pname, p in module.named_parameters(recurse=False):
        if pname not in wanted or p.ndim not in (2, 3):
            continue
        experts = p.shape[0] if p.ndim == 3 else 1
        if p.ndim == 3:
            fan_in, fan_out = (p.shape[1], p.shape[2]) if transposed else (p.shape[2], p.shape[1])
        else:
            fan_in, fan_out = p.shape[1], p.shape[0]
        if mod.A.shape[1] == fan_in and mod.B.shape[0] == fan_out and mod.A.shape[0] % experts == 0:
            fits.append((pname, experts, transposed and p.ndim == 3, p.ndim == 2))
    if len(fits) != 1:
        raise MergeError(
            f"Adapter module {module_name}: its LoRA A {tuple(mod.A.shape)} / B {tuple(mod.B.shape)} fit "
            f"{'no' if not fits else 'more than one'} parameter of the base's {type(module).__name__}: was the "
            "adapter trained on another model size?"
        )
    return fits[0]


class _Layout:
    """Where a model parameter lives in the checkpoint: its own tensor, or one tensor per expert (and per half of
    gate_up) as the architecture's conversion mapping stacks and concatenates them on load."""

    def __init__(self, model_type: str | None, tensors: dict):
        self.tensors = tensors
        self.renamings, self.converters = [], []
        try:
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping

            mapping = get_checkpoint_conversion_mapping(model_type) or []
        except Exception:  # an older transformers: checkpoints then hold the model's own names
            mapping = []
        for c in mapping:
            ops = [type(o).__name__ for o in getattr(c, "operations", None) or []]
            if not ops:
                self.renamings += [(s, t) for s, t in zip(c.source_patterns, c.target_patterns, strict=False)]
            elif (
                ops in (["MergeModulelist"], ["MergeModulelist", "Concatenate"])
                and len(c.target_patterns) == 1
            ):
                sources = [re.compile(re.escape(s).replace(r"\*", r"(\d+)")) for s in c.source_patterns]
                self.converters.append((sources, c.target_patterns[0]))

    def _renamed(self, key: str) -> str:
        for src, dst in self.renamings:
            key = re.sub(src, dst, key)
        return key

    def pieces(self, param_key: str) -> list[tuple[str, int | None, int]]:
        """[(checkpoint key, expert or None, first row in the expert's matrix)] of a model parameter."""
        out = []
        for key, info in self.tensors.items():
            renamed = self._renamed(key)
            if renamed == param_key:
                out.append((key, None, 0))
                continue
            for sources, target in self.converters:
                for j, pattern in enumerate(sources):
                    m = pattern.search(renamed)
                    if m and renamed[: m.start()] + target + renamed[m.end() :] == param_key:
                        out.append((key, int(m.group(1)), j * info.shape[0]))
        return out
