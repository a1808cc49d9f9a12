"""KTO (trl.KTOTrainer): unpaired feedback, one answer with a thumbs up or down (core.recipe.feedback)."""

from __future__ import annotations

from core.recipe.data import DataError, load_rows
from core.recipe.feedback import (
    normalize_feedback,
    prepare_feedback_datasets,
    preview_feedback,
    run_feedback_preflight,
)
from core.recipe.methods.base import Chart, Field, Method, PlanTraits, PreferenceHealth, fill_to
from core.recipe.methods.dpo import REFERENCE_FIELDS


class KTO(Method):
    def config_class(self):
        from trl import KTOConfig

        return KTOConfig

    def trainer_class(self):
        from trl import KTOTrainer

        return KTOTrainer

    def datasets(self, cfg: dict, tokenizer):
        return prepare_feedback_datasets(cfg)  # prompt/completion/label: KTOTrainer tokenizes them itself

    def preflight(self, cfg: dict, tokenizer=None, model_config=None, in_trainer: bool = False) -> list:
        return run_feedback_preflight(cfg, tokenizer, model_config)

    def check_columns(self, data_cfg: dict) -> str | None:
        try:
            rows, problems = normalize_feedback(load_rows(data_cfg), data_cfg.get("format", "auto"))
        except DataError as exc:
            return str(exc)
        if not rows:
            return (
                f"data.path: {data_cfg['path']} has no usable feedback rows: KTO reads prompt, completion and "
                "label (true/false), or preference pairs (prompt, chosen, rejected)."
            )
        return None

    def prompt_rows(self, data_cfg: dict) -> list:
        rows = load_rows(data_cfg)
        out, _ = normalize_feedback(rows.select(range(min(len(rows), 50))), data_cfg.get("format", "auto"))
        return [r["prompt"] for r in out]

    def preview(self, data_cfg: dict, n: int = 5, specs: list | None = None):
        return preview_feedback(load_rows(data_cfg), n=n, fmt=data_cfg.get("format", "auto"))

    def smoke_collator(self, pad_token_id: int, max_length: int):
        """DataCollatorForUnpairedPreference, then the answer and its KL twin filled up to training.max_length
        (attended, not scored), so the smoke step is the longest a run meets."""
        from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

        class Filled(DataCollatorForUnpairedPreference):
            def torch_call(self, examples):
                batch = super().torch_call(examples)
                fill = {"input_ids": pad_token_id, "attention_mask": 1, "completion_mask": 0}
                if "KL_input_ids" in batch:
                    fill.update({f"KL_{k}": v for k, v in fill.items()})
                return fill_to(batch, max_length, fill)

        return Filled(pad_token_id=pad_token_id, max_length=max_length)

    def measure_batch(self, generator, vocab_size: int, batch_size: int, seq_len: int, precompute_ref: bool):
        """DataCollatorForUnpairedPreference with KL completions: the rows and their mismatched KL twins, the
        second half of each the completion, labels alternating."""
        import torch

        batch = {}
        for prefix in ("", "KL_"):
            ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
            completion = torch.zeros_like(ids)
            completion[:, seq_len // 2 :] = 1
            batch.update(
                {
                    f"{prefix}input_ids": ids,
                    f"{prefix}attention_mask": torch.ones_like(ids),
                    f"{prefix}completion_mask": completion,
                }
            )
        batch["label"] = torch.arange(batch_size) % 2 == 0
        if precompute_ref:
            batch["ref_logps"] = -torch.rand(batch_size, generator=generator)
            batch["ref_KL_logps"] = -torch.rand(batch_size, generator=generator)
        return batch


METHOD = KTO(
    name="kto",
    label="KTO",
    trainer_name="trl.KTOTrainer",
    formats=("standard", "conversational"),
    columns=("prompt", "completion", "label", "chosen", "rejected"),
    summary="rated answers (thumbs up / down): the model learns to give answers like the good ones, not the bad",
    # a preference method on top of a model that can already answer: DPO's LoRA-sized rate; KTO estimates its KL
    # term from the other rows of a batch, so it needs at least two per device
    defaults={"learning_rate": 5e-6},
    smoke_batch_size=2,
    # KTOTrainer's fused head returns log_probs, entropy and mean_logits (no is_top1); its batch has KL twins
    traits=PlanTraits(
        rows_per_example=1,
        reference=True,
        flat_batches=False,
        head_outputs=1,
        head_is_top1=False,
        batch_tensors=6,
        label_tensors=2,
    ),
    metrics=("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"),
    charts=(
        Chart(
            "rewards",
            "Rewards of desirable and undesirable answers (KTO)",
            "reward",
            (
                ("rewards/chosen", "desirable"),
                ("rewards/rejected", "undesirable"),
                ("rewards/margins", "margin"),
            ),
            (("eval_rewards/margins", "eval margin"),),
        ),
        Chart("kl", "KL to the reference", "KL", (("kl", "train"),), (("eval_kl", "eval"),)),
        Chart(
            "logps",
            "Log-probs (desirable vs undesirable)",
            "log p",
            (("logps/chosen", "desirable"), ("logps/rejected", "undesirable")),
        ),
    ),
    headline=(("rewards/margins", "reward margin", ".3g"),),
    health=PreferenceHealth(
        accuracy=None,  # KTOTrainer logs no preference accuracy: its rows are not pairs
        good="desirable",
        bad="undesirable",
        learning_rate="LoRA KTO usually trains at 5e-6 to 5e-5; 5e-7 to 5e-6 is for full fine-tunes",
        loss_types="kto is standard KTO",
    ),
    fields=(
        Field("beta", "training.beta", "KTO beta", "float", 0.1, help="training.beta"),
        Field(
            "kto_loss",
            "training.loss_type",
            "KTO loss",
            "choice",
            "kto",
            ("kto", "apo_zero_unpaired"),
            help="training.loss_type",
        ),
        Field(
            "desirable",
            "training.desirable_weight",
            "Weight of good answers",
            "float",
            1.0,
            help="training.desirable_weight: raise it when good answers are rarer than bad ones",
        ),
        Field(
            "undesirable",
            "training.undesirable_weight",
            "Weight of bad answers",
            "float",
            1.0,
            help="training.undesirable_weight",
        ),
        *REFERENCE_FIELDS,
    ),
    data_noun="rated answers",
    row_noun="rated answers",
    choice="KTO (rated answers: thumbs up / down)",
    eval_kind="rated",
    measure_rows=(
        {"prompt": "hello", "completion": "HELLO!", "label": True},
        {"prompt": "world", "completion": "WORLD", "label": False},
    ),
)
