"""Evaluation per data source (issue #50 item 3): a run on a mix of data.sources that holds rows out evaluates each
source's held-out rows on their own, and logs eval_<source>_loss (core.recipe.mix.eval_names) beside the overall
eval_loss, in the same metrics line.

The trainer is given the sources' held-out rows as TRL's / transformers' dict of eval datasets (so TRL prepares
each as it prepares one). Left to itself, transformers would then evaluate and log each separately, with no
eval_loss at all (early stopping, the best checkpoint and the Monitor read that). Here one evaluation walks every
source's rows (each batch from one source) and logs, once, each source's loss and the overall eval_loss: the mean
over all held-out rows, weighted by rows, as transformers' eval_loss is over one dataset. No row is evaluated twice.
"""

from __future__ import annotations


def each_source(trainer_class):
    """`trainer_class` (a TRL trainer) evaluating a dict eval_dataset as one evaluation, source by source."""

    class EachSource(trainer_class):
        _each_source = False

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            parts = self.eval_dataset
            if eval_dataset is not None or not isinstance(parts, dict) or metric_key_prefix != "eval":
                return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
            self._each_source = True
            try:  # one source's name: the dataloader built for it is the first the loop below walks
                return super().evaluate(next(iter(parts)), ignore_keys, metric_key_prefix)
            finally:
                self._each_source = False

        def evaluation_loop(
            self,
            dataloader,
            description,
            prediction_loss_only=None,
            ignore_keys=None,
            metric_key_prefix="eval",
        ):
            if not self._each_source:
                return super().evaluation_loop(
                    dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
                )
            from transformers.trainer_utils import EvalLoopOutput

            metrics, rows, total = {}, 0, 0.0
            for name in self.eval_dataset:
                out = super().evaluation_loop(
                    self.get_eval_dataloader(name),
                    description,
                    prediction_loss_only,
                    ignore_keys,
                    f"eval_{name}",
                )
                loss = out.metrics.get(f"eval_{name}_loss")
                if loss is None:
                    continue
                metrics[f"eval_{name}_loss"] = loss
                rows += out.num_samples
                total += loss * out.num_samples
            if rows:
                metrics["eval_loss"] = total / rows
            return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=rows)

    EachSource.__name__ = EachSource.__qualname__ = f"{trainer_class.__name__}EachSource"
    return EachSource
