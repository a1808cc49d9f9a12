"""DPO (trl.DPOTrainer): preference pairs, a chosen and a rejected answer to one prompt (core.recipe.prefdata)."""

from __future__ import annotations

from core.recipe.data import DataError, load_rows
from core.recipe.methods.base import Chart, Field, Method, PlanTraits, PreferenceHealth, fill_to
from core.recipe.prefcheck import run_pair_preflight
from core.recipe.prefdata import (
    detect_pref_format,
    load_pref_rows,
    normalize_pairs,
    prepare_pair_datasets,
    preview_pairs,
)

# What TRL's DPOTrainer (and KTOTrainer) log on top of the loss, per logging step
PREFERENCE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
LOSS_TYPES = (
    "sigmoid",
    "ipo",
    "hinge",
    "robust",
    "bco_pair",
    "sppo_hard",
    "nca_pair",
    "apo_zero",
    "apo_down",
)
REFERENCE_FIELDS = (
    Field(
        "precompute",
        "training.precompute_ref_log_probs",
        "Precompute reference",
        "bool",
        False,
        help="training.precompute_ref_log_probs: the reference's log-probs once before training (no reference "
        "forward in each step)",
    ),
    Field(
        "reference",
        "model.reference_path",
        "Reference model folder (empty: the base with the adapter off)",
        "path",
        "",
        help="model.reference_path",
    ),
)
CHANCE_ACCURACY = 0.5  # a preference accuracy a coin flip gets: the line a DPO run must rise above


class DPO(Method):
    def config_class(self):
        from trl import DPOConfig

        return DPOConfig

    def trainer_class(self):
        from trl import DPOTrainer

        return DPOTrainer

    def datasets(self, cfg: dict, tokenizer):
        return prepare_pair_datasets(cfg)  # prompt/chosen/rejected: DPOTrainer tokenizes them itself

    def preflight(self, cfg: dict, tokenizer=None, model_config=None, in_trainer: bool = False) -> list:
        return run_pair_preflight(cfg, tokenizer, model_config)

    def check_columns(self, data_cfg: dict) -> str | None:
        try:
            detect_pref_format(load_rows(data_cfg), data_cfg.get("format", "auto"))
        except DataError as exc:
            return str(exc)
        return None

    def prompt_rows(self, data_cfg: dict) -> list:
        rows = load_rows(data_cfg)
        pairs = normalize_pairs(rows.select(range(min(len(rows), 50))), data_cfg.get("format", "auto"))
        return [p["prompt"] for p in pairs]

    def preview(self, data_cfg: dict, n: int = 5, specs: list | None = None):
        rows = load_pref_rows(data_cfg)
        return len(rows), preview_pairs(rows, n=n, fmt=data_cfg.get("format", "auto"))

    def smoke_collator(self, pad_token_id: int, max_length: int):
        """DataCollatorForPreference, then the chosen and the rejected row filled up to training.max_length
        (attended, not scored: completion_mask 0), so the smoke step is the longest a run meets."""
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        class Filled(DataCollatorForPreference):
            def torch_call(self, examples):
                fill = {"input_ids": pad_token_id, "attention_mask": 1, "completion_mask": 0}
                return fill_to(super().torch_call(examples), max_length, fill)

        return Filled(pad_token_id=pad_token_id, max_length=max_length)

    def measure_batch(self, generator, vocab_size: int, batch_size: int, seq_len: int, precompute_ref: bool):
        """DataCollatorForPreference: [chosen rows; rejected rows], the answer (second half) is the completion."""
        import torch

        ids = torch.randint(0, vocab_size, (2 * batch_size, seq_len), generator=generator)
        completion = torch.zeros_like(ids)
        completion[:, seq_len // 2 :] = 1
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}
        if precompute_ref:
            batch["ref_chosen_logps"] = -torch.rand(batch_size, generator=generator)
            batch["ref_rejected_logps"] = -torch.rand(batch_size, generator=generator)
        return batch


METHOD = DPO(
    name="dpo",
    label="DPO",
    trainer_name="trl.DPOTrainer",
    formats=("standard", "conversational"),
    columns=("prompt", "chosen", "rejected"),
    summary="preference pairs: the model learns to prefer each pair's chosen answer over the rejected one",
    # DPO trains a preference on top of a model that can already answer: a LoRA-sized DPO rate (the
    # alignment-handbook's QLoRA DPO recipe), not SFT's 2e-4
    defaults={"learning_rate": 5e-6},
    traits=PlanTraits(
        rows_per_example=2, reference=True, flat_batches=False, head_outputs=1, label_tensors=1
    ),
    metrics=PREFERENCE_METRICS,
    charts=(
        Chart(
            "rewards",
            "Rewards (DPO)",
            "reward",
            (("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"), ("rewards/margins", "margin")),
            (("eval_rewards/margins", "eval margin"),),
        ),
        Chart(
            "accuracy",
            "Preference accuracy",
            "accuracy",
            (("rewards/accuracies", "train"),),
            (("eval_rewards/accuracies", "eval"),),
            chance=CHANCE_ACCURACY,
            caption=(
                ("rewards/accuracies", "accuracy", ".2f"),
                ("eval_rewards/accuracies", "eval accuracy", ".2f"),
                ("rewards/margins", "margin", ".3g"),
            ),
        ),
        Chart(
            "logps",
            "Log-probs (chosen vs rejected)",
            "log p",
            (("logps/chosen", "chosen"), ("logps/rejected", "rejected")),
        ),
    ),
    headline=(("rewards/accuracies", "reward accuracy", ".2f"), ("rewards/margins", "reward margin", ".3g")),
    health=PreferenceHealth(
        accuracy="rewards/accuracies",
        good="chosen",
        bad="rejected",
        learning_rate="LoRA DPO usually trains at 5e-6 to 5e-5; 1e-6 is for full fine-tunes",
        loss_types="sigmoid is standard DPO",
    ),
    measure_rows=({"prompt": "hello", "chosen": "HELLO!", "rejected": "HELLO"},),
    fields=(
        Field("beta", "training.beta", "DPO beta", "float", 0.1, help="training.beta"),
        Field(
            "loss_type",
            "training.loss_type",
            "DPO loss",
            "choice",
            "sigmoid",
            LOSS_TYPES,
            help="training.loss_type",
            as_list=True,
        ),
        *REFERENCE_FIELDS,
    ),
    data_noun="preference pairs",
    row_noun="pairs",
    choice="DPO (preference pairs)",
    eval_kind="pairs",
)
