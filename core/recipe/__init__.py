"""The run description: what a run is, below both the planner and the engine. The run config (config,
config_keys, schema), the training methods (methods/), the data formats and their checks (data, prefdata, prefcheck,
feedback, findings, prompts, vision, vision_checks), GRPO's reward specs (rewards), the trackers, the multi-GPU
layout (distributed), and the library config objects derived from a config (engine_args)."""
