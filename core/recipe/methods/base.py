"""What a training method is: everything that differs between SFT, DPO, KTO and GRPO, in one object.

A method module (sft.py, dpo.py, kto.py, grpo.py) subclasses `Method` and fills it in: its TRL config and trainer
classes, its data formats, loader, preflight and preview, its smoke collator, what the planner must know of its
step (`PlanTraits`), the figures its trainer logs and the Monitor charts they feed, its Train-page fields and
the rows and batch a measured step uses. Code outside core/train/methods asks the run's method
(`core.recipe.methods.get`) instead of branching on its name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.recipe.data import DataError, add_unique, user_text


@dataclass(frozen=True)
class PlanTraits:
    """What the memory planner must know about a method's training step (core.estimate reads these)."""

    rows_per_example: int = 1  # DPO: a chosen and a rejected row per example
    reference: bool = False  # a reference model: the base with the adapter off, or a copy
    flat_batches: bool = True  # padding-free / packing exist for this trainer (TRL 1.16: SFT only)
    # extra (tokens,) fp32 outputs the fused LM head returns for the method's metrics (mean_logits: DPO, KTO)
    head_outputs: int = 0
    head_is_top1: bool = True  # the fused head's is_top1 output (SFT's token accuracy; GRPO asks for none)
    # a generation phase before each training step (GRPO: completions generated, scored and their no-grad
    # log-probs taken); the Plan's completion_len, num_generations, generation_batch, kl_beta, old_logps, vllm*
    # fields describe it (`Method.plan_shape`)
    generates: bool = False
    kl_reference: bool = False  # a reference model only when the plan's kl_beta > 0 (GRPO's beta)
    # (rows x length) int64 tensors its collator gives a batch (ids, attention mask, labels or completion mask;
    # KTO's KL twins double them), and the labels its trainer derives from them at each step (DPO 1, KTO 2): what
    # an evaluation holds of the last training batch and of its own (GRPO's rollouts are planned as such)
    batch_tensors: int = 3
    label_tensors: int = 0


@dataclass(frozen=True)
class Chart:
    """One Monitor chart of a method's own figures: series (metric key, label), train and eval."""

    key: str
    title: str
    y: str
    train: tuple[tuple[str, str], ...]
    eval: tuple[tuple[str, str], ...] = ()
    chance: float | None = None  # a reference line (e.g. a coin flip's preference accuracy)
    # the last figures shown under it: (metric key, label, format)
    caption: tuple[tuple[str, str, str], ...] = ()
    # series named at run time, one per logged key prefix + <name> + suffix (GRPO: rewards/<function>/mean), with
    # a label format ("{} std"): (prefix, suffix, label)
    families: tuple[tuple[str, str, str], ...] = ()
    optional: bool = False  # drawn only once logged (KL: only with beta > 0)


@dataclass(frozen=True)
class PreferenceHealth:
    """What the Monitor's preference rules (core.monitor.health) judge for a method that learns preferences from
    TRL's rewards/* figures, in that method's own words."""

    accuracy: str | None  # the preference accuracy it logs (a coin flip is 0.5); None: it logs none
    good: str  # what its data calls the preferred answers ("chosen", "desirable")
    bad: str
    learning_rate: str  # the usual range, for the advice
    loss_types: str  # which training.loss_type is the standard one


@dataclass(frozen=True)
class RewardHealth:
    """What the Monitor's reward rules (core.monitor.health_rewards) judge for a method that learns from reward
    functions scored on its own completions (GRPO): the figures its trainer logs and the settings that fix them."""

    reward: str  # the mean reward of a logging step's completions
    per_function: tuple[str, str]  # (prefix, suffix) of each function's mean reward: rewards/<name>/mean
    zero_spread: str  # the share of groups whose completions all scored alike (no learning signal)
    clipped: str  # the share of completions cut at the length limit
    mean_length: str
    spread_settings: str  # what gives a group more varied completions
    length_setting: str  # the completion length limit


@dataclass(frozen=True)
class Field:
    """One run-config setting as the pages show it: the one field table (ui/fields.py holds the common ones; a method
    lists its own in `Method.fields`, shown and written only for its runs, since the other methods' TRL configs do
    not know the key). The Train and Estimate pages draw, fill and read every field through it."""

    name: str  # the widget's key on a page: the page's prefix + name (tr_beta on the Train page)
    path: str  # the run config's key path: "training.beta" ("method": the top-level key)
    label: str
    kind: str  # "text" | "path" | "int" | "float" | "bool" | "choice" | "targets"
    default: Any = None  # a method's own field: its value when the config has none
    choices: tuple = ()
    help: str = ""
    as_list: bool = False  # the library takes a list (DPOConfig.loss_type); the form edits its first item
    step: float | None = None
    fmt: str | None = None
    flat_only: bool = (
        False  # SFTTrainer's batch shapes (padding-free, packing): off without traits.flat_batches
    )

    @property
    def section(self) -> str:
        return self.path.partition(".")[0]

    @property
    def key(self) -> str:
        return self.path.partition(".")[2]


@dataclass(frozen=True)
class Method:
    name: str  # the run config's `method`
    label: str  # what the pages show
    trainer_name: str  # the TRL class, for sentences
    formats: tuple[str, ...]  # data.format values (besides auto)
    columns: tuple[str, ...]  # the columns data.columns may map onto
    summary: str = ""
    defaults: dict = field(default_factory=dict)  # training defaults that differ from SFT's
    traits: PlanTraits = PlanTraits()
    smoke_batch_size: int = 1  # the smallest batch its trainer takes (KTO's KL term needs two rows)
    # the cockpit's own training keys of this method, described as core.recipe.schema describes the libraries'
    # (GRPO: max_prompt_length, which TRL 1.16 no longer has); the engine takes them out before the TRL config
    own_training: dict = field(default_factory=dict)
    # the figures its trainer logs beyond loss / learning rate / grad norm (their eval twins: eval_<name>)
    metrics: tuple[str, ...] = ()
    charts: tuple[Chart, ...] = ()
    # keys its trainer logs under names only known at run time (GRPO: rewards/<function>/mean and /std, one per
    # reward function): (prefix, suffix); the log readers keep every key that starts and ends so
    metric_families: tuple[tuple[str, str], ...] = ()
    # the figures the Runs page and `runs list` summarise a run by (eval twin preferred): (key, label, format)
    headline: tuple[tuple[str, str, str], ...] = ()
    health: PreferenceHealth | None = None  # the Monitor's preference rules, in this method's words
    # the Monitor's reward rules; a method that has them is judged by its rewards, not by its loss (GRPO's loss
    # hovers near 0 by construction: neither a flat loss nor a "spike" says anything there)
    reward_health: RewardHealth | None = None
    reward_functions: bool = (
        False  # its run config has a `rewards` list (core.recipe.rewards): the Train form edits it
    )
    fields: tuple[Field, ...] = ()  # its own settings on the Train page
    data_noun: str = "rows"  # what its data is, for sentences: "preference pairs", "rated answers"
    row_noun: str = "rows"  # what one row is, counted: "512 pairs"
    choice: str = ""  # the method as the Train page offers it: "DPO (preference pairs)"
    # what core.eval scores on held-out rows: "answers" (greedy answers against reference answers), "pairs"
    # (chosen against rejected answers: preference accuracy, reward margins), "rated" (answers rated good or bad),
    # "rewards" (greedy answers to held-out prompts scored by the run's own reward functions)
    eval_kind: str = "answers"
    # what early stopping and load_best_model_at_end judge checkpoints by: (its eval metric, greater is better)
    best_metric: tuple[str, bool] = ("eval_loss", False)

    # -- the libraries' classes ------------------------------------------------------------------------------
    def config_class(self):
        raise NotImplementedError

    def trainer_class(self):
        raise NotImplementedError

    @property
    def schema_section(self) -> str:
        """The key of this method's training section in core.recipe.schema (read from config_class)."""
        return "training" if self.name == "sft" else f"training_{self.name}"

    # -- data --------------------------------------------------------------------------------------------------
    def datasets(self, cfg: dict, tokenizer):
        """(train, eval or None) as its trainer takes them."""
        raise NotImplementedError

    def preflight(self, cfg: dict, tokenizer=None, model_config=None, in_trainer: bool = False) -> list:
        """The data's findings. in_trainer: the trainer process runs it (the user's own code may run there)."""
        raise NotImplementedError

    def sequence_length(self, cfg: dict) -> int:
        """The longest row its trainer's forward sees, in tokens (what the planner plans per row)."""
        return cfg["training"]["max_length"]

    def prompt_length(self, cfg: dict) -> int:
        """The longest prompt its rows can have, in tokens (a smoke test's sample answers start from one)."""
        return self.sequence_length(cfg)

    def smoke_batch(self, cfg: dict) -> int:
        """The batch size of its smoke step (and of the plan that step is compared with)."""
        return self.smoke_batch_size

    def smoke_eval_batch(self, cfg: dict) -> int:
        """The eval batch of its smoke test's one eval step (and of the plan that step is compared with)."""
        return self.smoke_batch(cfg)

    def eval_rows(self, cfg: dict, eval_batch: int) -> int:
        """Held-out rows one eval batch of `eval_batch` is made of (GRPO: prompts, each asked several times)."""
        return eval_batch

    def plan_shape(self, cfg: dict, batch_size: int, world: int, smoke: bool) -> dict:
        """The planner's fields (core.estimate Plan) that describe this method's own step, beyond the ones every
        method has, read from the run config: nothing here; a generating method's rollouts (traits.generates).
        `batch_size`: the per-device batch planned; `world`: processes; `smoke`: the smoke test's one step."""
        return {}

    def training_of_plan(self, get, training: dict) -> dict:
        """The inverse of `plan_shape`: the training keys that give a plan's own fields (`get(name)`: the plan's
        value or None), as they should stand in `training` (the run config's section, read, not changed)."""
        return {}

    def check_columns(self, data_cfg: dict) -> str | None:
        """None when the data loads and has the columns this method needs; else one sentence."""
        raise NotImplementedError

    def smoke_collator(self, pad_token_id: int, max_length: int):
        """The collator of the smoke step: rows filled to max_length, so it measures the longest step."""
        raise NotImplementedError

    def preview(self, data_cfg: dict, n: int = 5, specs: list | None = None) -> tuple[int, list[dict]] | None:
        """(rows in the data, the first n as the page shows them), or None where the page has a richer view of
        its own (SFT: tokens, masking and lengths). specs: the run's reward functions, for a method that has them
        (the preview shows the columns they read)."""
        return None

    @property
    def reads_text_formats(self) -> bool:
        """Its rows are core.recipe.data's text formats (detected, tokenized, masked: SFT's), not a view of its
        own (preview)."""
        return type(self).preview is Method.preview

    def sample_prompts(self, data_cfg: dict, n: int = 3) -> list[str]:
        """The first `n` prompts of its data as a user would type them: what "Try it" asks the adapter."""
        try:
            rows = self.prompt_rows(data_cfg)
        except DataError:
            return []
        out: list[str] = []
        for prompt in rows:
            if add_unique(out, user_text(prompt), n):
                break
        return out

    def sample_rows(self, rows, tokenizer, n: int) -> list[dict]:
        """The first `n` held-out rows as {"prompt": text, "prompt_ids", "reference"}: what the trainer's samples
        callback asks at each evaluation (training.eval_samples). Here: rows with a prompt column and a chosen
        answer or a completion (DPO, KTO), tokenized as their trainers do."""
        from core.recipe.prefdata import pair_token_ids

        out = []
        for row in rows.select(range(min(n, len(rows)))):
            answer = row.get("chosen", row.get("completion"))
            ids, _, _ = pair_token_ids({"prompt": row["prompt"], "chosen": answer, "rejected": ""}, tokenizer)
            text = "".join(m["content"] for m in answer) if isinstance(answer, list) else str(answer)
            out.append({"prompt": user_text(row["prompt"]), "prompt_ids": ids, "reference": text})
        return out

    def prompt_rows(self, data_cfg: dict) -> list:
        """The prompts of its first rows (a preference method's prompt column, normalized)."""
        return []

    # -- measuring a step (core.measure) -------------------------------------------------------------------------
    # one tiny row of its data, enough to build its trainer around a model whose step is then measured
    measure_rows: tuple[dict, ...] = ({"input_ids": [1, 2, 3], "labels": [1, 2, 3]},)
    # (trainer method, phase): calls that are a phase of their own in a measured step, beside the forward,
    # backward and optimizer phases the tracker names by itself (GRPO's rollouts: "generation")
    measure_phases: tuple[tuple[str, str], ...] = ()

    def measure_batch(self, generator, vocab_size: int, batch_size: int, seq_len: int, precompute_ref: bool):
        """A full batch of random tokens as its trainer's collator gives it, or None for SFT's own rules
        (core.measure.step.make_batch: padded or padding-free)."""
        return None

    # -- training --------------------------------------------------------------------------------------------
    def trainer_kwargs(self, cfg: dict, load_reference, train_ds=None) -> dict:
        """Extra keyword arguments of its trainer: a reference model loaded by `load_reference(path)` when the
        config names one (model.reference_path). train_ds: the rows it trains on."""
        path = cfg["model"].get("reference_path")
        return {"ref_model": load_reference(path)} if path and self.traits.reference else {}


def fill_to(batch: dict, max_length: int, fill: dict) -> dict:
    """Each tensor of `fill` in `batch` widened to max_length columns with its fill value (a smoke step's rows are
    as long as the longest a run can meet)."""
    import torch  # heavy: only a smoke step needs it

    for key, value in fill.items():
        extra = max_length - batch[key].shape[1]
        if extra > 0:
            pad = torch.full((batch[key].shape[0], extra), value, dtype=batch[key].dtype)
            batch[key] = torch.cat([batch[key], pad], dim=1)
    return batch
