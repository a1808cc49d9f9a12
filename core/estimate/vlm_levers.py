"""A vision-language model's own changes for "What would make it fit": fewer pixels per image (Qwen-VL's
max_pixels, GLM-4.xV's too: fewer image tokens, fewer patches through the vision tower) and fewer images per row. Each is the
largest setting that fits, found by re-estimating; both cost what the model sees of the images."""

from __future__ import annotations

from dataclasses import replace

from core.estimate.plan import FIT_LIMIT, Plan, PlanError
from core.estimate.specs import ModelSpec, SpecError
from core.estimate.vlm import image_tokens, vlm_of


def _fits(plan: Plan, spec: ModelSpec, estimate) -> bool:
    try:
        e = estimate(plan, spec)
    except (PlanError, SpecError):
        return False
    return e.device_total_bytes <= FIT_LIMIT * e.gpu_bytes


def pixels_per_token(facts) -> int:
    """max_pixels per image token: one merged cell (GLM's processor counts a still image twice against it)."""
    return (facts.patch_size * facts.merge_size) ** 2 * (2 if facts.rule == "glm" else 1)


def largest_max_pixels(plan: Plan, spec: ModelSpec, estimate) -> int:
    """The largest max_pixels (a multiple of one merged token's pixels) below the image's resized area that fits;
    0 when none does (down to the processor's 4 tokens)."""
    facts = vlm_of(spec)
    unit = pixels_per_token(facts)
    now = image_tokens(facts, plan).tokens
    lo, hi = 4, now - 1  # in tokens: invariant lo fits (checked), hi + 1 does not
    if hi < lo or not _fits(replace(plan, max_pixels=lo * unit), spec, estimate):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(replace(plan, max_pixels=mid * unit), spec, estimate):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


def vlm_candidates(plan: Plan, spec: ModelSpec, estimate) -> list[tuple[str, dict, str, bool]]:
    """(label, plan change, cost, keeps what is trained) of the image changes that could lower the bill."""
    facts = vlm_of(spec)
    if facts is None:
        return []
    out = []
    now = image_tokens(facts, plan).tokens
    if facts.rule in ("qwen", "glm") and now > 4:
        pixels = largest_max_pixels(plan, spec, estimate) or max(4, now // 4) * pixels_per_token(facts)
        fewer = image_tokens(facts, replace(plan, max_pixels=pixels)).tokens
        out.append(
            (
                f"max_pixels {pixels:,} ({fewer:,} image tokens per image instead of {now:,})",
                {"max_pixels": pixels},
                "images resized smaller: fewer image tokens, less detail the model sees (small text, fine parts)",
                False,
            )
        )
    if plan.images_per_row > 1:
        n = plan.images_per_row - 1
        while n > 1 and not _fits(replace(plan, images_per_row=n), spec, estimate):
            n -= 1
        out.append(
            (
                f"{n} image(s) per row instead of {plan.images_per_row}",
                {"images_per_row": n},
                "rows with fewer images: the data changes (split or drop the rows with more)",
                False,
            )
        )
    return out
