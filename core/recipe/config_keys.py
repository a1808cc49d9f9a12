"""The run config's own vocabulary: its sections, the cockpit's defaults where they differ from the libraries',
the keys the engine owns, names from other tools, renamed keys, ranges and the cockpit's own sections' schema."""

from __future__ import annotations

from typing import Any

from core.recipe import methods

METHODS = methods.NAMES


SECTIONS = ("model", "quantization", "lora", "data", "training", "distributed")


# rewards: a GRPO run's reward functions, a list (core.recipe.rewards checks it)
TOP_LEVEL = ("method", *SECTIONS, "rewards")


DTYPES = ("auto", "float32", "bfloat16", "float16")


ATTN = ("eager", "sdpa", "flash_attention_2", "flex_attention")


# distributed.strategy: how the work is spread over several GPUs (core.recipe.distributed writes the accelerate
# config for each; auto = DDP when the plan fits one card, else FSDP)
STRATEGIES = ("auto", "ddp", "fsdp", "deepspeed_zero3")


# Suggestions for the Train page's selectors (every other value the library accepts is valid too).
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)


OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",
    "adafactor",
    "sgd",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "lion_8bit",
    "paged_lion_8bit",
)


# The cockpit's defaults where they differ from the libraries' (LoRA-sized learning rate, a short max_length
# for the first run, bf16 only where the GPU has it). Everything not listed takes the library's default.
DEFAULTS: dict[str, Any] = {
    "method": "sft",
    "model": {
        "path": None,  # a local folder or a hub id already in the local cache (required)
        "dtype": "auto",  # auto: bfloat16 on a CUDA GPU that supports it, float32 otherwise
        "attn_implementation": "sdpa",
        "trust_remote_code": False,
        "reference_path": None,  # DPO/KTO: an explicit reference model (default: the base with the adapter off)
    },
    "quantization": {
        "load_in_4bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "auto",  # auto: the dtype the weights are loaded in
    },
    "lora": {
        "enabled": True,  # false: full fine-tuning (the planner's method "full")
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "target_modules": "all-linear",
        "bias": "none",
        "use_rslora": False,
    },
    "data": {
        "path": None,  # a .json/.jsonl/.csv/.parquet file, a list of them, a save_to_disk folder, or a Hub
        # dataset id ORG/NAME[@REVISION] (required)
        "subset": None,  # a Hub dataset's subset (its config name); None: its default
        "format": "auto",
        "columns": {},  # rename map, e.g. {"instruction": "question", "output": "answer"}
        "split": "train",  # which split of a DatasetDict folder (or of a Hub dataset) to train on
        "eval_split": 0.0,  # fraction of rows held out for eval_loss (0 = no eval)
        "mask_prompt": True,  # train on the answer only, with any chat template
    },
    "training": {
        "max_length": 512,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "num_train_epochs": 1.0,
        "max_steps": -1,
        "learning_rate": 2e-4,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.03,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "bf16": "auto",  # auto: on when the CUDA GPU supports bf16 natively; never on a CPU
        "fp16": False,
        "gradient_checkpointing": True,  # TRL's default: what makes long sequences fit
        "optim": "adamw_torch",
        "logging_steps": 10,
        "eval_steps": None,  # None: same as logging_steps when data.eval_split > 0
        "save_steps": 200,
        "save_total_limit": 2,
        "seed": 42,
        # the run's own tracker, in its folder (core.recipe.trackers): what the engine used when a config named none
        "report_to": "tensorboard",
    },
    # One GPU unless said otherwise; several GPUs (and machines) go through accelerate (core.recipe.distributed).
    "distributed": {
        "gpus": 1,  # how many GPUs of this machine (a count), or which (nvidia-smi's ids, e.g. [0, 2])
        "strategy": "auto",  # auto | ddp | fsdp | deepspeed_zero3
        "fsdp_version": "auto",  # auto: FSDP2 for a 16-bit base, FSDP1 (the QLoRA recipe) for a 4-bit one
        "cpu_offload": False,  # fsdp / deepspeed_zero3: parameters, gradients and optimizer states in CPU RAM
        "num_machines": 1,
        "machine_rank": 0,  # this machine's rank (0: the main one)
        "main_process_ip": None,  # the main machine's address (needed with num_machines > 1)
        "main_process_port": None,  # None: 29500 between machines; a free one on one machine
    },
}


# Keys whose meaning the cockpit owns: the run directory, the logs the UI reads, the data pipeline and the model
# loading are the engine's. Each maps to the sentence that says where the setting lives instead.
OWNED = {
    "training": {
        "output_dir": "the engine writes checkpoints into the run directory (core.train --run-dir)",
        "logging_dir": "the engine logs into the run directory (metrics.jsonl)",
        "overwrite_output_dir": "a run directory is never overwritten; start a new run instead",
        "resume_from_checkpoint": "resume a run with `python -m core.train ... --resume` (or Resume in the app)",
        "disable_tqdm": "the engine turns progress bars off so that stderr.log stays readable",
        "logging_nan_inf_filter": "the engine must see NaN losses to stop the run",
        "remove_unused_columns": "the engine feeds the trainer tokenized columns only",
        "use_cpu": "the engine picks the device (a CUDA GPU when there is one)",
        "model_init_kwargs": "the engine loads the model: use the model and quantization sections",
        "trust_remote_code": "set model.trust_remote_code",
        "dataset_text_field": "the engine tokenizes the data itself: set data.format and data.columns",
        "dataset_kwargs": "the engine tokenizes the data itself: set data.format and data.columns",
        "completion_only_loss": "the engine masks the prompt itself: set data.mask_prompt",
        "assistant_only_loss": "the engine masks the prompt itself: set data.mask_prompt",
        "pad_token": "the engine pads with the tokenizer's pad token (eos when it has none)",
        "chat_template_path": "the engine uses the model folder's chat template",
        "fsdp": "set distributed.strategy: fsdp (the engine writes the accelerate config into the run directory)",
        "fsdp_config": "set distributed.strategy: fsdp (the engine writes the accelerate config into the run directory)",
        "deepspeed": "set distributed.strategy: deepspeed_zero3 (the engine writes the accelerate config)",
    },
    "lora": {
        "task_type": "the engine trains causal language models (CAUSAL_LM)",
        "peft_type": "this section is LoRA",
        "base_model_name_or_path": "the base is model.path",
        "revision": "the base is model.path",
        "inference_mode": "the adapter is trained",
        "auto_mapping": "set by peft",
        "peft_version": "set by peft",
    },
    "quantization": {
        "load_in_8bit": "8-bit training is not planned or tested here: use load_in_4bit (QLoRA) or none",
    },
}


# Names people bring from other tools -> where the setting lives here.
ALIASES = {
    "max_length": "training.max_length",
    "seq_len": "training.max_length",
    "cutoff_len": "training.max_length",
    "sequence_len": "training.max_length",
    "lr": "training.learning_rate",
    "epochs": "training.num_train_epochs",
    "num_epochs": "training.num_train_epochs",
    "batch_size": "training.per_device_train_batch_size",
    "micro_batch_size": "training.per_device_train_batch_size",
    "lora_r": "lora.r",
    "rank": "lora.r",
    "alpha": "lora.lora_alpha",
    "dropout": "lora.lora_dropout",
    "model_name_or_path": "model.path",
    "base_model": "model.path",
    "dataset": "data.path",
    "torch_dtype": "model.dtype",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "optim": "training.optim",
    "optimizer": "training.optim",
    "load_in_4bit": "quantization.load_in_4bit",
    "num_gpus": "distributed.gpus",
    "num_processes": "distributed.gpus",
    "gpu_ids": "distributed.gpus",
    "nproc_per_node": "distributed.gpus",
    "nnodes": "distributed.num_machines",
    "node_rank": "distributed.machine_rank",
    "master_addr": "distributed.main_process_ip",
    "master_port": "distributed.main_process_port",
}


# Sanity ranges the libraries do not check themselves (a negative learning rate trains "fine" for a while).
RANGES: dict[str, tuple] = {
    "lora.r": (1, 4096),
    "lora.lora_alpha": (0, None, "open"),
    "lora.lora_dropout": (0, 1, "right-open"),
    "training.max_length": (8, 1_048_576),
    "training.per_device_train_batch_size": (1, 65536),
    "training.per_device_eval_batch_size": (1, 65536),
    "training.gradient_accumulation_steps": (1, 65536),
    "training.num_train_epochs": (0, 10000, "open"),
    "training.learning_rate": (0, 1, "left-open"),
    "training.weight_decay": (0, 1),
    "training.max_grad_norm": (0, None),
    "training.logging_steps": (0, None, "open"),
    "training.save_steps": (0, None, "open"),
    "training.eval_steps": (0, None, "open"),
    "training.save_total_limit": (1, None),
    "training.seed": (0, 2**32 - 1),
    "training.dataloader_num_workers": (0, 256),
    "distributed.num_machines": (1, 4096),
    "distributed.machine_rank": (0, 4095),
    "distributed.main_process_port": (1, 65535),
    "data.eval_split": (0, 0.5, "right-open"),
    "data.max_pixels": (1, None),
    "data.images_per_row": (1, 1024),
    "training.eval_samples": (0, 1000),
    "training.early_stopping_patience": (1, 100_000),
    "training.early_stopping_threshold": (0, None),
}


# A vision-language model's image settings (core.recipe.vision). Absent is the default: the tower frozen, the
# processor's own max_pixels, no pan-and-scan, and image_size / images_per_row read from the data (its largest image,
# its most images in a row; core.recipe.vision.data_images) -- they are planning inputs: the engine trains on the
# images as they are. On a text model they are ignored with a preflight warning.
IMAGE_SCHEMA = {
    "image_size": {"kinds": ["str", "none"]},  # "WxH" of the planned images, e.g. 1024x768
    "max_pixels": {"kinds": ["int", "none"]},  # Qwen-VL: each image resized into this many pixels
    "images_per_row": {"kinds": ["int", "none"]},
    "pan_and_scan": {"kinds": ["bool"]},  # Gemma 3: crops of a wide or tall image too
}


# The cockpit's own sections, described the way core.recipe.schema describes the libraries' fields.
OWN_SCHEMA = {
    "model": {
        "path": {"kinds": ["str"]},
        "dtype": {"kinds": ["str"], "choices": list(DTYPES)},
        "attn_implementation": {"kinds": ["str"], "choices": list(ATTN)},
        "trust_remote_code": {"kinds": ["bool"]},
        "reference_path": {"kinds": ["str", "none"]},
        "freeze_vision": {"kinds": ["bool"]},
    },
    "data": {
        # none: a mix of data.sources (a validated one writes path: null; config_combos asks for one or the other)
        "path": {"kinds": ["str", "list", "none"]},
        "format": {
            "kinds": ["str"],
            "choices": list(
                dict.fromkeys(("auto",) + tuple(f for m in methods.REGISTRY.values() for f in m.formats))
            ),
        },
        "columns": {"kinds": ["dict"]},
        "subset": {"kinds": ["str", "none"]},
        "split": {"kinds": ["str"]},
        "eval_split": {"kinds": ["float"]},
        "mask_prompt": {"kinds": ["bool"]},
        # several sources mixed (core.recipe.mix_config checks them, with sentences naming the source)
        "sources": {"kinds": ["any"]},
        "mix": {"kinds": ["any"]},
        **IMAGE_SCHEMA,
    },
    "distributed": {
        "gpus": {"kinds": ["int", "list"]},
        "strategy": {"kinds": ["str"], "choices": list(STRATEGIES)},
        "fsdp_version": {"kinds": ["str", "int"]},
        "cpu_offload": {"kinds": ["bool"]},
        "num_machines": {"kinds": ["int"]},
        "machine_rank": {"kinds": ["int"]},
        "main_process_ip": {"kinds": ["str", "none"]},
        "main_process_port": {"kinds": ["int", "none"]},
    },
}


# The cockpit's own keys in the training section (not the TRL config's: the engine takes them out before it).
# eval_samples: greedy answers to this many fixed held-out prompts at each evaluation, into samples.jsonl
# (core.train.eval_callbacks); 0 (the default) is off.
# early_stopping_patience / _threshold: transformers' EarlyStoppingCallback (stop once the method's eval metric has
# not improved by more than the threshold for this many evaluations); the best checkpoint becomes the adapter.
SAMPLES_EXTRA_TOKENS, SAMPLES_MAX_TOKENS = 8, 128  # an answer: its reference's length and a little more
OWN_TRAINING = {
    "eval_samples": {"kinds": ["int"]},
    "early_stopping_patience": {"kinds": ["int", "none"]},
    "early_stopping_threshold": {"kinds": ["float"]},
}


# Values the cockpit adds to a library field: "auto" precision/dtype is resolved by the engine per device.
EXTRA_VALUES = {"training.bf16": ("auto",), "quantization.bnb_4bit_compute_dtype": ("auto",)}


COLUMN_KEYS = tuple(dict.fromkeys(c for m in methods.REGISTRY.values() for c in m.columns))


# Keys that moved or that a library renamed: (section, old key) -> (section, new key, value map). The config is
# stored under the current names; an old spelling from another tool or an older release still reads.
RENAMED = {
    ("data", "max_length"): ("training", "max_length", None),
    ("training", "max_seq_length"): ("training", "max_length", None),
    ("training", "evaluation_strategy"): ("training", "eval_strategy", None),
    # transformers 5 turned the flag into a sampling strategy
    ("training", "group_by_length"): (
        "training",
        "train_sampling_strategy",
        {True: "group_by_length", False: None},
    ),
    ("model", "torch_dtype"): ("model", "dtype", None),
}
