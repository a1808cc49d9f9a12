"""Health warnings for a live run, from its metrics, GPU samples and plan (no UI).

Each warning names what is wrong with the figures that show it and what to change. `HealthChecker` is
stateful only where that saves work each tick: loss-spike detection looks at new loss points only, and the
"first 200 steps" verdict is settled once.

A run whose method learns preferences (DPO, KTO: its core.recipe.methods module carries `health`, the rules' words
for it) is also checked for not learning them: the preference accuracy stuck at a coin flip (DPO logs one), the
reward margin not rising, and the preferred answers' log-probs collapsing while the margin grows. They judge only
the points logged after a warm-up share of training.max_steps, and only once there are enough of them. A run
whose method learns from reward functions (GRPO: `reward_health`) is judged by its rewards instead of its loss
(core.monitor.health_rewards).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from core.fmt import gib
from core.monitor.advice import HealthWarning
from core.monitor.health_rewards import reward_warnings
from core.monitor.tail import RunSeries
from core.recipe import methods
from core.recipe.methods.base import Method

GiB = 1024**3


@dataclass
class HealthSettings:
    util_threshold: float = 80.0  # percent
    util_window_s: float = 120.0  # sustained = this long
    memory_fraction: float = 0.90
    spike_window: int = 50  # loss points in the rolling median
    spike_factor: float = 2.0  # loss above factor x median ...
    spike_noise: float = 5.0  # ... and above median + k x noise, noise = median |step-to-step change|
    flat_steps: int = 200
    flat_ratio: float = 0.97  # loss near step 200 must be below ratio x the starting loss
    plan_tolerance: float = 0.10
    plan_min_steps: int = 5  # the peak (optimizer states, longest batch) shows only after a few steps
    # DPO: judged on the points logged after this share of the run's max steps (of the last logged step while
    # the max is unknown): the reference and the policy start equal, every figure starts at chance
    dpo_warmup_share: float = 0.1
    dpo_window: int = 20  # logged points judged (the last ones); fewer after the warm-up: no verdict yet
    dpo_chance_band: float = 0.1  # accuracy within 0.5 ± band over the window = a coin flip
    dpo_collapse_ratio: float = 0.5  # chosen reward fell by at least this share of the margin's rise
    # GRPO (core.monitor.health_rewards): a reward 0 at this many logged points in a row, this far into the run,
    # cannot be earned; a share at or above reward_share over the last reward_window points is "every group"
    reward_zero_points: int = 3
    reward_zero_steps: int = 20
    reward_window: int = 3
    reward_share: float = 0.95


class HealthChecker:
    """Call `check(series, plan, status)` every tick with the same growing `RunSeries`."""

    def __init__(self, settings: HealthSettings | None = None):
        self.s = settings or HealthSettings()
        self._spike_cursor = 0
        self._spikes: list[tuple[float, float, float]] = []  # (step, loss, median)
        self._flat: HealthWarning | None | bool = False  # False = not decided yet
        self._series_id: int | None = None

    def check(
        self,
        series: RunSeries,
        plan: dict | None = None,
        status: dict | None = None,
        method: str | None = None,
    ) -> list[HealthWarning]:
        """`method`: the run's (its config's); None: told by its figures (rewards/* are a preference run's)."""
        if id(series) != self._series_id:  # a rebuilt series (file replaced): forget what we learned
            self.__init__(self.s)
            self._series_id = id(series)
        state = (status or {}).get("state")
        live = state in (None, "starting", "running")
        m = methods.get(method) if method else methods.from_metrics(series.metrics)
        pref = m.health is not None
        rewards = (
            m.reward_health
        )  # judged by its rewards: its loss is no learning curve (GRPO's hovers near 0)
        chance = self._dpo_chance(m, series, status, live) if pref else None
        out: list[HealthWarning] = []
        for w in (
            self._nonfinite(
                series,
                live=state in (None, "starting", "running"),
                on_cpu=(status or {}).get("device") == "cpu",
            ),
            self._memory(series, plan),
            self._utilization(series) if state in (None, "starting", "running") else None,
            None if rewards else self._spikes_warning(series),
            # a preference loss starts at ln 2 and its own rules say whether it learns (with its advice, not SFT's)
            None if pref or rewards else self._loss_flat(series),
            self._plan(series, plan),
            chance,
            # a margin that does not rise is what an accuracy at chance already says: one cause, one warning
            None if chance or not pref else self._dpo_margin_flat(m, series, status, live),
            self._dpo_collapse(m, series, status, live) if pref else None,
            *(reward_warnings(series, rewards, self.s) if rewards else ()),
        ):
            if w is not None:
                out.append(w)
        order = {"error": 0, "warning": 1, "info": 2}
        return sorted(out, key=lambda w: order.get(w.level, 3))

    # --- rules -----------------------------------------------------------------------------------------

    def _nonfinite(self, series: RunSeries, live: bool = True, on_cpu: bool = False) -> HealthWarning | None:
        """Advice fits the run's state (an ended run is not stopped again) and device (no fp16 on a CPU)."""
        for name in ("loss", "eval_loss"):
            steps, vals = series.metric(name)
            bad = ~np.isfinite(vals)
            if bad.any():
                first = int(np.argmax(bad))
                return HealthWarning(
                    "nonfinite_loss",
                    "error",
                    f"{'Training' if name == 'loss' else 'Eval'} loss is {vals[first]} (not a number)",
                    f"{name} became {vals[first]} at step {int(steps[first])}; {int(bad.sum())} of {vals.size} "
                    "logged values are NaN/inf. Training past this point learns nothing.",
                    ("Stop the run and restart" if live else "Restart")
                    + " from the last good checkpoint with a lower training.learning_rate (try 10x lower) and "
                    "training.max_grad_norm=1.0"
                    + ("" if on_cpu else "; if fp16 is on, switch to bf16 (fp16 overflows above 65504)")
                    + ".",
                )
        return None

    def _memory(self, series: RunSeries, plan: dict | None) -> HealthWarning | None:
        t, used = series.gpu_series("memory_used")
        _, total = series.gpu_series("memory_total")
        if used.size and total.size and total[-1] > 0:
            recent = used[t >= t[-1] - 30.0]  # the last 30 s, so one reading does not flicker the warning
            peak, cap = float(recent.max()), float(total[-1])
            source = "GPU memory in use (NVML, all processes)"
        else:
            _, reserved = series.metric("cuda_reserved")
            cap = float((plan or {}).get("gpu_bytes") or 0)  # the card the plan was made for
            if not reserved.size or cap <= 0:
                return None
            peak = float(np.nanmax(reserved[-20:]))
            source = "PyTorch reserved memory"
        frac = peak / cap
        if frac <= self.s.memory_fraction:
            return None
        return HealthWarning(
            "memory_high",
            "warning",
            f"GPU memory {frac:.0%} full",
            f"{source}: {gib(peak, 1)} of {gib(cap, 1)} ({frac:.0%}, limit {self.s.memory_fraction:.0%}). A longer "
            "batch or an eval pass can run out of memory.",
            "Lower training.per_device_train_batch_size (raise training.gradient_accumulation_steps to keep the effective batch), "
            "lower training.max_length, enable training.gradient_checkpointing, or load the model in 4-bit (QLoRA).",
        )

    def _utilization(self, series: RunSeries) -> HealthWarning | None:
        t, util = series.gpu_series("utilization")
        if not util.size or series.first_time is None:
            return None
        # Only samples since training began (the first metrics line): loading the model idles the GPU too.
        start = max(t[-1] - self.s.util_window_s, series.first_time)
        sel = t >= start
        if t[-1] - start < 0.8 * self.s.util_window_s or sel.sum() < 5:
            return None
        window = util[sel]
        mean = float(window.mean())
        low = float((window < self.s.util_threshold).mean())
        if mean >= self.s.util_threshold or low < 0.75:
            return None
        return HealthWarning(
            "low_utilization",
            "warning",
            "GPU is waiting: data loading is the bottleneck",
            f"Utilisation averaged {mean:.0f}% over the last {t[-1] - start:.0f} s ({sel.sum()} samples, "
            f"{low:.0%} of them under {self.s.util_threshold:.0f}%).",
            "Raise training.dataloader_num_workers (e.g. 4), set training.dataloader_pin_memory=True, tokenise the dataset once "
            "before training instead of on the fly, and set training.train_sampling_strategy: group_by_length "
            "(or training.packing: true) to cut padding; a larger training.per_device_train_batch_size also "
            "gives the GPU more work per step.",
        )

    def _spikes_warning(self, series: RunSeries) -> HealthWarning | None:
        steps, loss = series.metric("loss")
        n = loss.size
        if n > self._spike_cursor:
            start = max(self._spike_cursor, 10)  # need some history before calling anything a spike
            if n > start:
                self._spikes.extend(self._find_spikes(steps, loss, start, n))
            self._spike_cursor = n
        if not self._spikes:
            return None
        step, v, med = max(self._spikes, key=lambda s: s[1] / max(s[2], 1e-12))
        last = self._spikes[-1]
        return HealthWarning(
            "loss_spike",
            "warning",
            f"Loss spiked {len(self._spikes)} time(s)",
            f"Largest: {v:.4g} at step {int(step)} against a rolling median of {med:.4g} "
            f"({v / max(med, 1e-12):.1f}x); latest at step {int(last[0])}.",
            "Lower training.learning_rate, keep training.max_grad_norm=1.0, use a warmup (training.warmup_steps 0.03-0.1), and check the "
            "data around those steps for very long or broken samples.",
        )

    def _find_spikes(self, steps, loss, start: int, n: int) -> list[tuple[float, float, float]]:
        """Spikes among loss[start:n], each judged against the `spike_window` points before it (vectorised)."""
        w = self.s.spike_window
        hist_from = max(0, start - w)
        seg = np.where(np.isfinite(loss[hist_from:n]), loss[hist_from:n], np.nan)
        # Trailing windows that end just before each candidate; NaN-padded at the very start of the run.
        lead = w - (start - hist_from)
        padded = np.concatenate([np.full(lead, np.nan), seg[:-1]])
        windows = np.lib.stride_tricks.sliding_window_view(padded, w)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows give NaN, which never matches
            med, noise = _median_and_noise(windows, clean_from=0 if np.isnan(seg).any() else lead)
            count = (~np.isnan(windows)).sum(axis=1)
            v = seg[start - hist_from :]
            hit = (
                (count >= 10)
                & (v > self.s.spike_factor * med)
                & (v - med > self.s.spike_noise * np.maximum(noise, 1e-8))
            )
        idx = np.nonzero(hit)[0]
        return [(float(steps[start + i]), float(v[i]), float(med[i])) for i in idx]

    def _loss_flat(self, series: RunSeries) -> HealthWarning | None:
        if self._flat is not False:
            return self._flat or None
        steps, loss = series.metric("loss")
        if not steps.size or steps[-1] < self.s.flat_steps:
            return None
        early = loss[(steps <= self.s.flat_steps) & np.isfinite(loss)]
        if early.size < 6:
            self._flat = None  # too few logged points to judge; settle quietly
            return None
        k = max(3, early.size // 10)
        first, last = float(np.median(early[:k])), float(np.median(early[-k:]))
        self._flat = None
        if last > self.s.flat_ratio * first:
            self._flat = HealthWarning(
                "loss_flat",
                "warning",
                f"Loss has not fallen over the first {self.s.flat_steps} steps",
                f"Median loss {first:.4g} over the first {k} logged points and {last:.4g} over the last {k} up "
                f"to step {self.s.flat_steps}.",
                "Raise training.learning_rate (LoRA usually trains at 1e-4 to 3e-4) and check that warmup is not most of "
                "these steps; check that the labels are not all masked (-100) and that the chat template matches "
                "the model; make sure LoRA targets the attention/MLP projections.",
            )
        return self._flat

    def _plan(self, series: RunSeries, plan: dict | None) -> HealthWarning | None:
        if not plan or series.last_step is None or series.last_step < self.s.plan_min_steps:
            return None
        pairs = [
            (
                "cuda_peak",
                "tensor_peak_bytes",
                "PyTorch peak allocated",
                lambda: series.metric("cuda_peak")[1],
            ),
            (
                "cuda_reserved",
                "reserved_peak_bytes",
                "PyTorch reserved",
                lambda: series.metric("cuda_reserved")[1],
            ),
            (
                "process_memory",
                "device_total_bytes",
                "the run's GPU memory (NVML)",
                lambda: series.gpu_series("process_memory")[1],
            ),
        ]
        for _, plan_key, label, get in pairs:
            predicted = plan.get(plan_key)
            values = get()
            values = values[np.isfinite(values)] if values.size else values
            if not predicted or not values.size:
                continue
            measured = float(values.max())
            dev = measured / float(predicted) - 1.0
            if abs(dev) <= self.s.plan_tolerance:
                return None
            over = dev > 0
            return HealthWarning(
                "plan_mismatch",
                "warning" if over else "info",
                f"Measured peak is {abs(dev):.0%} {'above' if over else 'below'} the plan",
                f"{label}: measured {gib(measured, 1)}, planned {gib(float(predicted), 1)} ({plan_key}); tolerance "
                f"{self.s.plan_tolerance:.0%}.",
                (
                    "Less headroom than planned: keep an eye on the memory chart, and before raising batch size or "
                    "sequence length run the Smoke test to measure; the plan may miss an activation or the "
                    "longest batch of this dataset."
                    if over
                    else "More headroom than planned: a larger training.per_device_train_batch_size or training.max_length "
                    "may fit (confirm with the Smoke test)."
                ),
            )
        return None

    # --- preference rules (DPO, KTO) ---------------------------------------------------------------------------

    def _dpo_points(self, series: RunSeries, name: str, status: dict | None) -> tuple[np.ndarray, np.ndarray]:
        """The finite points of a preference figure logged after the warm-up; empty when too few to judge."""
        steps, vals = series.metric(name)
        if not steps.size:
            return steps, vals
        max_steps = (status or {}).get("max_steps")
        horizon = max_steps if isinstance(max_steps, (int, float)) and max_steps > 0 else float(steps[-1])
        keep = (steps > self.s.dpo_warmup_share * horizon) & np.isfinite(vals)
        steps, vals = steps[keep], vals[keep]
        if steps.size < self.s.dpo_window:
            return np.empty(0), np.empty(0)
        return steps, vals

    def _dpo_chance(
        self, m: Method, series: RunSeries, status: dict | None, live: bool
    ) -> HealthWarning | None:
        h = m.health
        if h.accuracy is None:
            return None
        steps, acc = self._dpo_points(series, h.accuracy, status)
        if not acc.size:
            return None
        n = self.s.dpo_window
        steps, acc = steps[-n:], acc[-n:]
        mean = float(acc.mean())
        half = n // 2
        rising = float(acc[half:].mean() - acc[:half].mean())
        band = self.s.dpo_chance_band
        if abs(mean - 0.5) > band or rising > band / 2:  # above chance, or on its way up
            return None
        margin = _last_finite(series, "rewards/margins")
        evals = _last_finite(series, "eval_" + h.accuracy)
        return HealthWarning(
            "preference_chance_accuracy",
            "warning",
            f"{m.label} is not learning the preferences: accuracy is stuck at chance (0.5)",
            f"{h.accuracy} averaged {mean:.2f} over the last {n} logged points (steps {int(steps[0])}-"
            f"{int(steps[-1])}); 0.5 is a coin flip, so the model does not yet rank the {h.good} answer above the "
            f"{h.bad} one"
            + (f"; the reward margin is {margin:.3g}" if margin is not None else "")
            + (f"; eval accuracy {evals:.2f}" if evals is not None else "")
            + ".",
            ("Stop the run and relaunch" if live else "Relaunch")
            + f" with a higher training.learning_rate ({h.learning_rate}) and a warmup that is not most of the run; "
            f"check that the {h.good} and {h.bad} answers really differ and are not swapped in the data, and that "
            f"training.loss_type is the one you meant ({h.loss_types}).",
        )

    def _dpo_margin_flat(
        self, m: Method, series: RunSeries, status: dict | None, live: bool
    ) -> HealthWarning | None:
        steps, margins = self._dpo_points(series, "rewards/margins", status)
        if not margins.size:
            return None
        n = self.s.dpo_window
        k = max(3, n // 4)
        _, everything = series.metric("rewards/margins")
        everything = everything[np.isfinite(everything)]
        start = float(np.median(everything[:k]))  # where the run began: policy = reference, margin ~ 0
        window = margins[-n:]
        now = float(np.median(window[-k:]))
        noise = float(
            np.median(np.abs(np.diff(window)))
        )  # a batch-to-batch wobble, in the margin's own units
        if now - start > noise:
            return None
        h = m.health
        return HealthWarning(
            "preference_margin_flat",
            "warning",
            f"{m.label} reward margin is not rising",
            f"rewards/margins: median {start:.3g} over the first {k} logged points and {now:.3g} over the last {k} "
            f"(to step {int(steps[-1])}), a rise of {now - start:.3g} against a point-to-point wobble of "
            f"{noise:.3g}: the {h.good} answers are not gaining on the {h.bad} ones.",
            ("Stop the run and relaunch" if live else "Relaunch")
            + f" with a higher training.learning_rate ({h.learning_rate}) or a higher training.beta (the margin is "
            "beta times the log-ratio gap, so a tiny beta keeps it near 0); check that LoRA targets the "
            "attention/MLP projections and that training.loss_type is the one you meant.",
        )

    def _dpo_collapse(
        self, m: Method, series: RunSeries, status: dict | None, live: bool
    ) -> HealthWarning | None:
        """rewards/chosen falling steadily while rewards/margins rise: the model wins the margin by pushing the
        preferred answers down too (their log-prob collapses), a known DPO failure (KTO's rewards/chosen are its
        desirable answers')."""
        steps, chosen = self._dpo_points(series, "rewards/chosen", status)
        m_steps, margins = self._dpo_points(series, "rewards/margins", status)
        if not chosen.size or not margins.size:
            return None
        q = [float(np.median(part)) for part in np.array_split(chosen, 4)]
        mq = [float(np.median(part)) for part in np.array_split(margins, 4)]
        fall, rise = q[0] - q[-1], mq[-1] - mq[0]
        noise_c = float(np.median(np.abs(np.diff(chosen))))
        noise_m = float(np.median(np.abs(np.diff(margins))))
        steady = all(a > b for a, b in zip(q, q[1:], strict=False))
        if not (
            steady
            and q[-1] < 0
            and fall > noise_c
            and rise > noise_m
            and fall >= self.s.dpo_collapse_ratio * rise
        ):
            return None
        logps = series.metric("logps/chosen")[1]
        logps = logps[np.isfinite(logps)]
        h = m.health
        return HealthWarning(
            "preference_chosen_collapse",
            "warning",
            f"{m.label} is pushing the {h.good} answers down: their log-probs are collapsing",
            f"Over steps {int(min(steps[0], m_steps[0]))}-{int(steps[-1])} rewards/chosen fell steadily (median "
            f"{q[0]:.3g} in the first quarter, {q[-1]:.3g} in the last) while rewards/margins rose from {mq[0]:.3g} "
            f"to {mq[-1]:.3g}"
            + (f"; logps/chosen went from {logps[0]:.4g} to {logps[-1]:.4g}" if logps.size >= 2 else "")
            + f": the margin grows because both answers lose probability, the {h.bad} ones faster, and the "
            f"model drifts away from the {h.good} answers it should learn.",
            (
                "Stop the run (a checkpoint from before the fall may be the better adapter) and relaunch"
                if live
                else "Prefer a checkpoint from before the fall, or relaunch"
            )
            + " with a lower training.learning_rate (try 2-5x lower) or a higher training.beta (try twice this "
            "run's: it keeps the policy closer to the reference).",
        )


def _last_finite(series: RunSeries, name: str) -> float | None:
    _, v = series.metric(name)
    v = v[np.isfinite(v)]
    return float(v[-1]) if v.size else None


def _median_and_noise(windows: np.ndarray, clean_from: int) -> tuple[np.ndarray, np.ndarray]:
    """Per window: median, and noise = median |step-to-step change| (not the spread around the median:
    early in a run the loss falls steeply and the spread would hide any spike).

    Windows from `clean_from` on hold no NaN and take the fast np.median; the rest need nanmedian.
    """
    med = np.empty(len(windows))
    noise = np.empty(len(windows))
    for part, fn in ((slice(0, clean_from), np.nanmedian), (slice(clean_from, None), np.median)):
        w = windows[part]
        if len(w):
            med[part] = fn(w, axis=1)
            noise[part] = fn(np.abs(np.diff(w, axis=1)), axis=1)
    return med, noise
