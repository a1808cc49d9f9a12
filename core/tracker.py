"""Measured truth for the memory planner: the bytes held by live tensors during one real training step.

On any device (the CPU included) a `TorchDispatchMode` sees the outputs of every op. Each storage is counted once
(views share their base's storage, in-place ops return it) and a `weakref.finalize` on the storage subtracts its
bytes when it is freed, so `current_bytes` follows what a caching allocator's "allocated" counter would show,
without allocator rounding. Storages alive before the step (weights, adapter, optimizer state, the batch) are
registered up front as the baseline; a storage first met as an op *input* that nobody registered (created before
the mode, or in C++ outside the dispatcher) is adopted at that moment and reported as `adopted_bytes`.
`saved_tensors_hooks` mark the storages autograd saves for backward (`saved_bytes`).

On CUDA, torch's allocator statistics and NVML's used memory are reported next to it, separately.

    with track_live_tensors(model=model, optimizer=opt) as tracker:
        with tracker.phase("forward"):
            loss = model(**batch).loss
        ...
    tracker.result().peak_bytes
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from core.gpu import NvmlSource

PHASES = ("forward", "backward", "optimizer")
# Phases during which a later step also holds the optimizer state the first step made at its end (generation:
# an RL trainer's rollouts, GRPO's, marked with `held_phase`).
STATE_PHASES = ("forward", "backward", "generation")
STEP = "step"  # the phase name when nobody names phases (e.g. the mode around trainer.train())


def main_phase(name: str) -> str:
    """ "backward:first-layer" -> "backward": sub-phases name a moment inside a phase."""
    return name.split(":", 1)[0]


def main_phase_peaks(peaks: dict[str, int]) -> dict[str, int]:
    """Per-phase peaks with the sub-phases folded into their phase."""
    out: dict[str, int] = {}
    for name, b in peaks.items():
        out[main_phase(name)] = max(out.get(main_phase(name), 0), b)
    return out


class TrackerError(ValueError):
    """A bad input to the tracker, with a sentence saying what to change."""


@dataclass
class StepMemory:
    """What one measured training step held. Bytes throughout."""

    device: str
    baseline_bytes: int  # alive when the step began: weights, adapter, optimizer state, batch
    peak_bytes: int  # most bytes held by live tensors at once
    peak_phase: str  # forward / backward / optimizer, or "step" when no phases were named
    phase_peaks: dict[str, int]  # may hold sub-phases ("backward:first-layer"); see main_phase_peaks
    saved_bytes: int  # peak of the activations autograd saved for backward (weights excluded)
    end_bytes: int  # alive after the step (weights + optimizer state once created)
    optimizer_state_bytes: int  # created in the optimizer phase and still alive: lazily made state
    steady_peak_bytes: int  # a later step's peak: that state is then alive during forward and backward too
    steady_peak_phase: str
    steady_phase_peaks: dict[str, int]
    adopted_bytes: int  # storages nobody registered that were met as inputs (should be 0 with model given)
    seconds: float
    cuda: dict | None = None  # allocated_peak, reserved_peak, allocated_start, nvml_used (bytes) on CUDA
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Entry:
    nbytes: int
    phase: str
    kind: str  # "baseline" | "new" | "adopted"
    saved: bool = False
    finalizer: weakref.finalize | None = None
    origin: str = ""  # "op shape dtype" of the tensor that made it (only with detail=True)


def _storage(x) -> torch.UntypedStorage | None:
    """The tensor's storage when it holds real memory we can count, else None."""
    if not isinstance(x, torch.Tensor) or x.is_sparse or x.device.type == "meta":
        return None
    try:
        return x.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses, functional tensors
        return None


def _is_paged(x) -> bool:
    """bitsandbytes marks its paged (CUDA managed memory) tensors with is_paged = True."""
    return getattr(x, "is_paged", False) is True


def module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a model holds: parameters, buffers, their grads and bitsandbytes quantization state
    (absmax, nested absmax, code maps hang off `weight.quant_state`, not registered as buffers)."""
    out: list[torch.Tensor] = []
    for t in list(model.parameters()) + list(model.buffers()):
        out.append(t)
        if getattr(t, "grad", None) is not None:
            out.append(t.grad)
        qs = getattr(t, "quant_state", None)
        while qs is not None:  # bnb QuantState, nested one level for double quantization
            out += [v for v in vars(qs).values() if isinstance(v, torch.Tensor)]
            qs = getattr(qs, "state2", None)
        out += [v for k, v in vars(t).items() if k in ("SCB", "CB") and isinstance(v, torch.Tensor)]  # int8
    return out


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (exp_avg, exp_avg_sq, bnb's state1/state2/qmap/absmax...)."""
    if optimizer is None:
        return []
    return [t for st in optimizer.state.values() for t in tree_leaves(st) if isinstance(t, torch.Tensor)]


_LIFT_OPS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: LiveTensorTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = self.tracker
        kwargs = kwargs or {}
        # An op running inside an autograd node is backward (this includes checkpoint recomputation).
        if t.auto_phases and torch._C._current_autograd_node() is not None:
            t._auto_phase("backward")
        # torch.tensor(data) builds its tensor in C++ outside the dispatcher and hands it to lift_fresh:
        # that input is a new allocation, not an old one.
        kind = "new" if func in _LIFT_OPS else "adopted"
        for x in tree_leaves((args, kwargs)):
            st = _storage(x)
            if st is not None:
                t._track(st, kind, _is_paged(x))  # no-op for known storages
        out = func(*args, **kwargs)
        for x in tree_leaves(out):
            st = _storage(x)
            if st is not None:
                t._origin = f"{func} {tuple(x.shape)} {x.dtype}" if t.detail else ""
                t._track(st, "new")  # views and in-place results find their known storage
        t._origin = ""
        return out


class _PhaseScope:
    """Lets `with tracker.phase("forward"):` read as a block; the phase itself is set on the call."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class LiveTensorTracker:
    """Counts live tensor bytes while active; use through `track_live_tensors()`."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer=None,
        tensors=(),
        device: str | None = None,
        auto_phases: bool = False,
        saved_tensors: bool = True,
        detail: bool = False,
    ):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.detail = detail  # keep what made each storage and a list of the live ones at the peak (slow)
        self._origin = ""
        self.peak_detail: list[tuple[int, str, str, bool]] = []  # (bytes, phase made, origin, saved)
        self.phase_detail: dict[str, list] = {}  # the same at each phase's peak
        self.auto_phases = auto_phases
        self.saved_tensors = saved_tensors
        self._entries: dict[
            int, _Entry
        ] = {}  # storage._cdata -> entry (the key lives as long as the storage)
        self._phase = STEP
        self._held: str | None = None  # a phase named for a whole block: the auto phases leave it alone
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_phase = STEP
        self.phase_peaks: dict[str, int] = {}
        self.baseline_bytes = 0
        self.adopted_bytes = 0
        self.saved_current = 0
        self.saved_peak = 0
        self.cuda: dict | None = None
        self.seconds = 0.0
        self._opt_state_bytes = 0
        self._t0 = 0.0
        self._active = False
        self._pending = [*module_tensors(model)] if model is not None else []
        self._pending += optimizer_tensors(optimizer) + [
            t for t in tree_leaves(tensors) if torch.is_tensor(t)
        ]

    # -- bookkeeping -------------------------------------------------------------------------------------
    def _track(self, st: torch.UntypedStorage, kind: str, paged: bool = False) -> _Entry | None:
        key = st._cdata
        e = self._entries.get(key)
        if e is not None:
            n = st.nbytes()
            if n != e.nbytes:  # resize_ (out= ops, set_) changes a storage's size in place
                self.current_bytes += n - e.nbytes
                if e.saved:
                    self.saved_current += n - e.nbytes
                e.nbytes = n
                self._bump()
            return e
        # bitsandbytes' paged optimizer state (paged_adamw_*) is CUDA managed memory that torch sees as a CPU
        # tensor marked is_paged: it lives on the GPU while the optimizer runs, so it counts as "cuda".
        if (
            self.device is not None
            and st.device.type != self.device
            and not (paged and self.device == "cuda")
        ):
            return None
        n = st.nbytes()
        e = _Entry(n, self._phase, kind, origin=self._origin)
        e.finalizer = weakref.finalize(st, self._free, key)
        self._entries[key] = e
        self.current_bytes += n
        if kind == "adopted":
            self.adopted_bytes += n
        self._bump()
        return e

    def _free(self, key: int):
        e = self._entries.pop(key, None)
        if e is not None:
            self.current_bytes -= e.nbytes
            if e.saved:
                self.saved_current -= e.nbytes

    def _bump(self):
        cur = self.current_bytes
        if cur > self.phase_peaks.get(self._phase, -1):
            self.phase_peaks[self._phase] = cur
            if self.detail:
                self.phase_detail[self._phase] = [
                    (e.nbytes, e.phase, e.origin, e.saved)
                    for e in self._entries.values()
                    if e.kind != "baseline"
                ]
        if cur > self.peak_bytes:
            self.peak_bytes, self.peak_phase = cur, self._phase
            if self.detail:
                self.peak_detail = self.phase_detail[self._phase]

    def _set_phase(self, name: str):
        if name != self._phase:
            self._phase = name
            self._bump()  # what is held when a phase begins counts towards that phase's peak

    def _auto_phase(self, name: str):
        if self._held is None:
            self._set_phase(name)

    def _pack(self, x):
        st = _storage(x)
        if st is not None:
            e = self._track(st, "adopted")
            if e is not None and e.kind != "baseline" and not e.saved:
                e.saved = True
                self.saved_current += e.nbytes
                self.saved_peak = max(self.saved_peak, self.saved_current)
        return x

    # -- public ------------------------------------------------------------------------------------------
    def phase(self, name: str) -> _PhaseScope:
        """Name the phase from now on (forward / backward / optimizer); also usable as `with tracker.phase(..)`.
        The phase stays until the next one is named."""
        self._set_phase(name)
        return _PhaseScope()

    @contextlib.contextmanager
    def held_phase(self, name: str):
        """Name the phase for the whole block, whatever runs inside it (e.g. GRPO's generation: the auto phases
        would call its forwards "forward"); inside another held block, a sub-phase of it ("eval:generation")."""
        outer = self._held
        self._held = f"{outer}:{name}" if outer else name
        self._set_phase(self._held)
        try:
            yield self
        finally:
            self._held = outer
            if outer:
                self._set_phase(outer)

    def register(self, tensors, kind: str = "baseline"):
        """Count tensors that exist already (e.g. the batch); their storages are then known, never re-counted."""
        for t in tree_leaves(tensors):
            st = _storage(t)
            if st is not None:
                self._track(st, kind, _is_paged(t))

    def reset_peaks(self):
        """Start a new measured step: the bytes alive now become its baseline."""
        self.baseline_bytes = self.current_bytes
        self.peak_bytes, self.peak_phase = self.current_bytes, self._phase
        self.phase_peaks = {}
        self.saved_peak = self.saved_current
        self.adopted_bytes = 0
        for e in self._entries.values():
            e.phase = "before"  # state made in an earlier step is no longer "new in the optimizer phase"

    def result(self) -> StepMemory:
        opt_state = self._opt_state_bytes if not self._active else self._state_made_in_optimizer()
        steady = dict(self.phase_peaks)
        for p in steady:  # a later step holds that state all along
            if main_phase(p) in STATE_PHASES:
                steady[p] += opt_state
        steady_phase = max(steady, key=steady.get) if steady else STEP
        return StepMemory(
            device=self.device or _device_of(self.model),
            baseline_bytes=self.baseline_bytes,
            peak_bytes=self.peak_bytes,
            peak_phase=main_phase(self.peak_phase),
            phase_peaks=dict(self.phase_peaks),
            saved_bytes=self.saved_peak,
            end_bytes=self.current_bytes,
            optimizer_state_bytes=opt_state,
            steady_peak_bytes=steady.get(steady_phase, self.peak_bytes),
            steady_peak_phase=main_phase(steady_phase),
            steady_phase_peaks=steady,
            adopted_bytes=self.adopted_bytes,
            seconds=self.seconds,
            cuda=self.cuda,
        )

    def _state_made_in_optimizer(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.phase == "optimizer")

    def summary(self) -> dict:
        """The figures a smoke test writes (smoke.json keys)."""
        r = self.result()
        return {
            "peak_bytes": r.peak_bytes,
            "peak_phase": r.peak_phase,
            "steady_peak_bytes": r.steady_peak_bytes,
            "saved_bytes": r.saved_bytes,
            "baseline_bytes": r.baseline_bytes,
            "device": r.device,
            "cuda": r.cuda,
        }

    # -- context -----------------------------------------------------------------------------------------
    def __enter__(self) -> LiveTensorTracker:
        if self._active:
            raise TrackerError("this tracker is already active; create a new one with track_live_tensors()")
        self._active = True
        self._cuda_start()
        self.register(self._pending)
        self._pending = []
        self.reset_peaks()
        self._hooks = []
        if self.auto_phases:
            from torch.nn.modules.module import register_module_forward_pre_hook
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            def forward_pre(_module, _args):
                if torch._C._current_autograd_node() is None:  # recomputation in backward stays backward
                    self._auto_phase("forward")

            self._hooks.append(register_module_forward_pre_hook(forward_pre))
            self._hooks.append(register_optimizer_step_pre_hook(lambda *_: self._auto_phase("optimizer")))
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._saved = None
        if self.saved_tensors:
            self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
            self._saved.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._t0
        if self._saved is not None:
            self._saved.__exit__(*exc)
        self._mode.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._cuda_end()
        self._opt_state_bytes = self._state_made_in_optimizer()
        for e in self._entries.values():  # stop counting: the figures stay as they were at the end
            if e.finalizer is not None:
                e.finalizer.detach()
        self._entries = {}
        self._active = False
        return False

    # -- CUDA --------------------------------------------------------------------------------------------
    def _cuda_device(self):
        if not torch.cuda.is_available():
            return None
        if self.device not in (None, "cuda"):
            return None
        dev = _device_of(self.model)
        return (
            torch.device(dev) if dev.startswith("cuda") else torch.device("cuda", torch.cuda.current_device())
        )

    def _cuda_start(self):
        dev = self._cuda_device()
        if dev is None:
            return
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        # a bare "cuda" device means the current one, not necessarily index 0
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.cuda = {"index": index, "allocated_start": torch.cuda.memory_allocated(dev)}

    def _cuda_end(self):
        if self.cuda is None:
            return
        dev = torch.device("cuda", self.cuda["index"])
        torch.cuda.synchronize(dev)
        self.cuda["allocated_peak"] = torch.cuda.max_memory_allocated(dev)
        self.cuda["reserved_peak"] = torch.cuda.max_memory_reserved(dev)
        self.cuda["nvml_used"] = _nvml_used(self.cuda["index"])


def _device_of(model) -> str:
    if model is None:
        return "cpu"
    for p in model.parameters():
        return str(p.device)
    return "cpu"


def _nvml_used(index: int) -> int | None:
    """NVML's used memory of the card (whole card, all processes), or None without NVML.

    `index` is torch's CUDA index; NVML numbers every card of the machine in PCI order, while CUDA counts only
    CUDA_VISIBLE_DEVICES and by default puts the fastest first. The card's UUID says which NVML device it is."""

    src = NvmlSource()
    if src.init() is not None:
        return None
    nvml_index = _nvml_index_of_cuda(index, src.devices())
    return src.read(nvml_index).get("memory_used") if nvml_index is not None else None


def _uuid_key(uuid) -> str:
    """torch prints a CUDA UUID bare ("ffc79498-8ff3-..."), NVML prefixes it ("GPU-ffc79498-8ff3-...")."""
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _nvml_index_of_cuda(cuda_index: int, devices) -> int | None:
    """The NVML index of torch's CUDA device `cuda_index` by UUID; without UUIDs only an unambiguous guess
    (one card, nothing hidden by CUDA_VISIBLE_DEVICES), else None rather than another card's figure."""
    try:
        cuda_uuid = _uuid_key(torch.cuda.get_device_properties(cuda_index).uuid)
    except Exception:  # torch without the uuid property
        cuda_uuid = None
    if cuda_uuid:
        for d in devices:
            if getattr(d, "uuid", None) and _uuid_key(d.uuid) == cuda_uuid:
                return d.index
    if len(devices) == 1 and torch.cuda.device_count() == 1:
        return devices[0].index
    return None


def track_live_tensors(
    model: torch.nn.Module | None = None,
    optimizer=None,
    tensors=(),
    device: str | None = None,
    auto_phases: bool = False,
    saved_tensors: bool = True,
    detail: bool = False,
) -> LiveTensorTracker:
    """A context manager counting live tensor bytes. Pass the model and optimizer so that what they hold
    before the step is the baseline (otherwise their storages are adopted when first used). `device`
    ("cpu"/"cuda") counts only storages there. `auto_phases` names forward / backward / optimizer from
    global module and optimizer hooks (for a step run by someone else, e.g. transformers Trainer); without
    it and without `tracker.phase(...)` everything is phase "step"."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TrackerError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not hasattr(optimizer, "state"):
        raise TrackerError(f"optimizer must be a torch optimizer, got {type(optimizer).__name__}")
    return LiveTensorTracker(model, optimizer, tensors, device, auto_phases, saved_tensors, detail)
