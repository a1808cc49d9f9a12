"""GRPO (trl.GRPOTrainer): reinforcement learning with verifiable rewards. The model writes `num_generations`
completions per prompt (core.recipe.prompts), the run's reward functions score them (core.recipe.rewards), and
each completion is pushed towards the ones its group scored above their mean."""

from __future__ import annotations

from core.recipe import rewards as reward_specs
from core.recipe.data import DataError, load_rows, user_text
from core.recipe.methods.base import Chart, Field, Method, PlanTraits, RewardHealth
from core.recipe.prompts import (
    DEFAULT_MAX_PROMPT_LENGTH,
    max_prompt_length,
    normalize_prompts,
    prepare_prompt_datasets,
    preview_prompts,
    prompt_ids,
    row_finder,
    run_prompt_preflight,
)

# What trl.GRPOTrainer 1.16 logs on top of the loss (per logging step; eval twins carry eval_). Each reward
# function adds rewards/<name>/mean and /std (core.monitor reads those by their prefix).
GRPO_METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "kl",
    "entropy",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
)
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")


def eval_generations(cfg: dict) -> int:
    """Completions per prompt in an evaluation (GRPOConfig.num_generations_eval, else num_generations)."""
    t = cfg["training"]
    return t.get("num_generations_eval") or t.get("num_generations", 8)


class GRPO(Method):
    def config_class(self):
        from trl import GRPOConfig

        return GRPOConfig

    def trainer_class(self):
        from trl import GRPOTrainer

        return GRPOTrainer

    def smoke_batch(self, cfg: dict) -> int:
        """One prompt's group: the smallest batch whose generation batch divides by num_generations."""
        return cfg["training"].get("num_generations", 8)

    def smoke_eval_batch(self, cfg: dict) -> int:
        """One prompt's evaluation group (GRPOConfig: the eval batch divides by num_generations_eval)."""
        return eval_generations(cfg)

    def eval_rows(self, cfg: dict, eval_batch: int) -> int:
        """Prompts: GRPOTrainer's eval sampler asks each num_generations_eval times."""
        return max(1, eval_batch // eval_generations(cfg))

    def prompt_length(self, cfg: dict) -> int:
        return max_prompt_length(cfg)

    def sequence_length(self, cfg: dict) -> int:
        """A prompt and its completion: the policy's forward runs over both."""
        t = cfg["training"]
        return t.get("max_prompt_length", DEFAULT_MAX_PROMPT_LENGTH) + t.get("max_completion_length", 256)

    def plan_shape(self, cfg: dict, batch_size: int, world: int, smoke: bool) -> dict:
        """The rollouts of a step as GRPOConfig.__post_init__ and GRPOTrainer resolve them (trl 1.16); the smoke
        step (core.recipe.engine_args) generates one batch for one update."""
        t = cfg["training"]
        if smoke:
            generation, accumulation, iterations = batch_size, 1, 1
        else:
            accumulation, iterations = t["gradient_accumulation_steps"], t.get("num_iterations", 1)
            steps = t.get("steps_per_generation") or accumulation
            generation = (
                t["generation_batch_size"] // world if t.get("generation_batch_size") else batch_size * steps
            )
        vllm = (t.get("vllm_mode") or "colocate") if t.get("use_vllm") else "off"
        correction = vllm != "off" and t.get("vllm_importance_sampling_correction", True)
        return {
            "completion_len": t.get("max_completion_length", 256),
            "num_generations": t.get("num_generations", 8),
            "generation_batch": generation,
            "kl_beta": float(t.get("beta", 0.0)),
            # _generate_and_score_completions takes the old policy's log-probs when an update falls between two
            # generations, or to correct vLLM's sampling (importance sampling)
            "old_logps": accumulation % (max(1, generation // batch_size) * iterations) != 0
            or bool(correction),
            "vllm": vllm,
            "vllm_fraction": float(t.get("vllm_gpu_memory_utilization", 0.3)),
            "vllm_sleep": bool(t.get("vllm_enable_sleep_mode")),
        }

    def training_of_plan(self, get, training: dict) -> dict:
        """max_*_length, num_generations, beta, the vLLM keys; the generation batch as steps per generation
        (None: the key goes, its default -- gradient_accumulation_steps -- gives it); the old log-probs by
        num_iterations (a second update per generation is what makes TRL keep them)."""
        out: dict = {}
        completion, seq = get("completion_len"), get("seq_len")
        if completion:
            out["max_completion_length"] = int(completion)
            if seq:
                out["max_prompt_length"] = int(seq) - int(completion)
        for name, key in (
            ("num_generations", "num_generations"),
            ("kl_beta", "beta"),
            ("vllm_fraction", "vllm_gpu_memory_utilization"),
            ("vllm_sleep", "vllm_enable_sleep_mode"),
        ):
            if get(name) is not None:
                out[key] = get(name)
        if get("eval_generations"):  # 0: an evaluation asks for num_generations
            out["num_generations_eval"] = get("eval_generations")
        vllm = get("vllm") or ("colocate" if training.get("use_vllm") else "off")
        out["use_vllm"] = vllm != "off"
        if vllm != "off":
            out["vllm_mode"] = vllm
        batch = get("batch_size") or training.get("per_device_train_batch_size", 1)
        accumulation = training.get("gradient_accumulation_steps", 1)
        steps = max(1, (get("generation_batch") or batch) // batch)
        out["generation_batch_size"] = None
        out["steps_per_generation"] = None if steps == accumulation else steps
        want = get("old_logps")
        correction = vllm != "off" and training.get("vllm_importance_sampling_correction", True)
        iterations = training.get("num_iterations", 1)
        if want is not None and not correction and bool(accumulation % (steps * iterations)) != want:
            iterations = 1 if not want else 2
            while want and accumulation % (steps * iterations) == 0:
                iterations += 1
            out["num_iterations"] = iterations
        return out

    def sample_rows(self, rows, tokenizer, n: int) -> list[dict]:
        """Held-out prompts tokenized as GRPOTrainer does; the reference is the row's first other text column
        (what a reward function checks against, e.g. its answer), or empty."""
        out = []
        for row in rows.select(range(min(n, len(rows)))):
            others = [v for k, v in row.items() if k != "prompt" and isinstance(v, str)]
            ids = prompt_ids(row["prompt"], tokenizer)
            out.append(
                {"prompt": user_text(row["prompt"]), "prompt_ids": ids, "reference": (others or [""])[0]}
            )
        return out

    def datasets(self, cfg: dict, tokenizer):
        return prepare_prompt_datasets(
            cfg, tokenizer
        )  # prompts (+ the columns the rewards read): TRL tokenizes

    def preflight(self, cfg: dict, tokenizer=None, model_config=None, in_trainer: bool = False) -> list:
        return run_prompt_preflight(cfg, tokenizer, model_config, in_trainer)

    def check_columns(self, data_cfg: dict) -> str | None:
        try:
            rows, _ = normalize_prompts(load_rows(data_cfg), data_cfg.get("format", "auto"))
        except DataError as exc:
            return str(exc)
        if not rows:
            return (
                f"data.path: {data_cfg['path']} has no usable prompts: GRPO reads a prompt column (a text or a list of "
                "messages) and the columns its rewards compare with (e.g. answer)."
            )
        return None

    def prompt_rows(self, data_cfg: dict) -> list:
        rows = load_rows(data_cfg)
        out, _ = normalize_prompts(rows.select(range(min(len(rows), 50))), data_cfg.get("format", "auto"))
        return [r["prompt"] for r in out]

    def preview(self, data_cfg: dict, n: int = 5, specs: list | None = None):
        rows = load_rows(data_cfg)
        return len(rows), preview_prompts(rows, n=n, fmt=data_cfg.get("format", "auto"), specs=specs)

    def smoke_collator(self, pad_token_id: int, max_length: int):
        return (
            None  # GRPOTrainer batches its own generations; the smoke step generates full-length completions
        )

    def trainer_kwargs(self, cfg: dict, load_reference, train_ds=None) -> dict:
        rows = list(train_ds) if train_ds is not None else []
        return {
            "reward_funcs": reward_specs.build(cfg["rewards"], allow_code=True, where_of=row_finder(rows))
        }


METHOD = GRPO(
    name="grpo",
    label="GRPO",
    trainer_name="trl.GRPOTrainer",
    formats=("standard", "conversational"),
    columns=("prompt",),  # the columns rewards compare with are named in each reward (rewards[].column)
    summary="prompts and reward functions: the model learns from its own completions that score above their "
    "group's mean (reinforcement learning with verifiable rewards)",
    # TRL's 1e-6 is for full fine-tunes of large models: a LoRA adapter needs a LoRA-sized rate; prompts are
    # bounded by the cockpit (TRL 1.16 keeps them whole), completions by TRL's max_completion_length
    defaults={
        "learning_rate": 1e-5,
        "max_prompt_length": DEFAULT_MAX_PROMPT_LENGTH,
        "max_completion_length": 256,
        "num_generations": 8,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "log_completions": True,
        "num_completions_to_print": 2,  # stdout.log shows a sample; the Monitor reads them all from the files
    },
    own_training={"max_prompt_length": {"kinds": ["int"]}},
    # the fused head returns log-probs and entropy (no is_top1); beta > 0 asks for the reference's log-probs
    traits=PlanTraits(
        rows_per_example=1,
        reference=False,
        flat_batches=False,
        head_is_top1=False,
        generates=True,
        kl_reference=True,
        batch_tensors=0,
    ),
    metrics=GRPO_METRICS,
    metric_families=(("rewards/", "/mean"), ("rewards/", "/std")),
    charts=(
        Chart(
            "reward",
            "Reward (mean of each group's completions)",
            "reward",
            (("reward", "reward"), ("reward_std", "std within a group")),
            (("eval_reward", "eval reward"),),
            caption=(("reward", "reward", ".3f"), ("reward_std", "std", ".3f")),
        ),
        Chart(
            "functions",
            "Reward of each function (mean, std)",
            "reward",
            (),
            families=(("rewards/", "/mean", "{}"), ("rewards/", "/std", "{} std")),
        ),
        Chart(
            "length",
            "Completion length (tokens)",
            "tokens",
            (("completions/mean_length", "mean"), ("completions/max_length", "longest")),
            caption=(("completions/mean_length", "mean", ".1f"),),
        ),
        Chart(
            "signal",
            "Learning signal",
            "share",
            (
                ("frac_reward_zero_std", "groups with no reward spread"),
                ("completions/clipped_ratio", "completions cut at max length"),
            ),
            caption=(
                ("completions/clipped_ratio", "clipped", ".0%"),
                ("frac_reward_zero_std", "no spread", ".0%"),
            ),
        ),
        Chart(
            "kl",
            "KL to the reference (beta > 0)",
            "KL",
            (("kl", "train"),),
            (("eval_kl", "eval"),),
            optional=True,
        ),
        Chart("entropy", "Entropy of the completions", "nats", (("entropy", "train"),), optional=True),
        Chart(
            "clip",
            "Clipped policy ratios",
            "share",
            (
                ("clip_ratio/region_mean", "region"),
                ("clip_ratio/low_mean", "low"),
                ("clip_ratio/high_mean", "high"),
            ),
            optional=True,
        ),
    ),
    headline=(("reward", "reward", ".3f"),),
    reward_health=RewardHealth(
        reward="reward",
        per_function=("rewards/", "/mean"),
        zero_spread="frac_reward_zero_std",
        clipped="completions/clipped_ratio",
        mean_length="completions/mean_length",
        spread_settings="training.num_generations (more completions per prompt) or training.temperature",
        length_setting="training.max_completion_length",
    ),
    reward_functions=True,
    fields=(
        Field(
            "num_generations",
            "training.num_generations",
            "Completions per prompt",
            "int",
            8,
            help="training.num_generations: the group each completion is compared with (at least 2)",
        ),
        Field(
            "max_completion_length",
            "training.max_completion_length",
            "Max completion length (tokens)",
            "int",
            256,
            help="training.max_completion_length",
        ),
        Field(
            "max_prompt_length",
            "training.max_prompt_length",
            "Max prompt length (tokens)",
            "int",
            DEFAULT_MAX_PROMPT_LENGTH,
            help="training.max_prompt_length: longer prompts are left out",
        ),
        Field(
            "beta",
            "training.beta",
            "KL beta (0: no reference)",
            "float",
            0.0,
            help="training.beta: the KL penalty towards the base; 0 loads no reference",
        ),
        Field(
            "temperature",
            "training.temperature",
            "Sampling temperature",
            "float",
            1.0,
            help="training.temperature: higher gives more varied completions (more learning signal)",
        ),
        Field(
            "loss_type",
            "training.loss_type",
            "GRPO loss",
            "choice",
            "dapo",
            LOSS_TYPES,
            help="training.loss_type",
        ),
        Field(
            "scale_rewards",
            "training.scale_rewards",
            "Scale rewards",
            "choice",
            "group",
            SCALE_REWARDS,
            help="training.scale_rewards: divide advantages by the std of the group, the batch, or not",
        ),
        Field(
            "num_iterations",
            "training.num_iterations",
            "Updates per generation",
            "int",
            1,
            help="training.num_iterations",
        ),
        Field(
            "log_completions",
            "training.log_completions",
            "Log sample completions",
            "bool",
            True,
            help="training.log_completions: the Monitor's table of completions and their rewards",
        ),
    ),  # fmt: skip
    data_noun="prompts",
    row_noun="prompts",
    choice="GRPO (prompts + reward functions)",
    eval_kind="rewards",
    best_metric=("eval_reward", True),
    measure_rows=({"prompt": "Uppercase: hello", "answer": "HELLO"},),
    # the completions' generation, their rewards and the no-grad log-prob forwards (old policy, reference): the
    # planner's "generation" phase
    measure_phases=(("_generate_and_score_completions", "generation"),),
)
