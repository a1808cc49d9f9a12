"""The Estimate page's charts: the memory bill against the card, and the memory curves. altair and pandas are
imported when a chart is drawn (0.5 s on a fresh server), after the verdict is on screen."""

from core.estimate.plan import FIT_LIMIT, TARGET_LOW, GiB

# Segment colours: no greens and no reds, so the green target band and the red card line drawn over the bars
# cannot be mistaken for (or hidden by) a segment. One colour per component the bill can hold.
SEGMENT_COLOURS = [
    "#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#9467bd", "#c5b0d5", "#8c564b", "#c49c94",
    "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#17becf", "#9edae5", "#ffd16a",
]  # fmt: skip
BAND_COLOUR = "#2ca02c"  # the 85-90% target band (green)
CARD_COLOUR = "#d62728"  # the card's capacity (red)


def bill_chart(est):
    """The stacked bill against the card: the target band and the card's line drawn over the segments."""
    import altair as alt
    import pandas as pd

    rows = [
        {"component": k, "GiB": v / GiB, "order": i} for i, (k, v) in enumerate(est.components.items()) if v
    ]
    cap = est.gpu_bytes / GiB
    bars = (
        alt.Chart(pd.DataFrame(rows))
        .mark_bar()
        .encode(
            x=alt.X(
                "sum(GiB):Q",
                title="GiB",
                scale=alt.Scale(domain=[0, max(cap, est.device_total_bytes / GiB) * 1.05]),
            ),
            y=alt.Y("plan:N", title=None),
            # Legend below the bar in columns: beside a 120 px bar it is cut after five entries.
            color=alt.Color(
                "component:N",
                sort=[r["component"] for r in rows],
                scale=alt.Scale(range=SEGMENT_COLOURS),
                legend=alt.Legend(orient="bottom", columns=4, title=None, labelLimit=220),
            ),
            order=alt.Order("order:Q"),
            tooltip=["component", alt.Tooltip("GiB:Q", format=".2f")],
        )
        .transform_calculate(plan="'this plan'")
    )
    # Drawn after the bars, see-through with a dashed outline: under them it was hidden by the segments.
    band = (
        alt.Chart(pd.DataFrame([{"lo": cap * TARGET_LOW, "hi": cap * FIT_LIMIT}]))
        .mark_rect(fill=BAND_COLOUR, fillOpacity=0.35, stroke=BAND_COLOUR, strokeWidth=2, strokeDash=[4, 3])
        .encode(x="lo:Q", x2="hi:Q")
    )
    line = (
        alt.Chart(pd.DataFrame([{"cap": cap}])).mark_rule(color=CARD_COLOUR, strokeWidth=2).encode(x="cap:Q")
    )
    return alt.layer(bars, band, line).properties(height=230)


def curve_chart(rows: list[dict], name: str, cap_gib: float):
    """Device total along one knob (sequence length, batch size), against the card."""
    import altair as alt
    import pandas as pd

    df = pd.DataFrame([{name: r[name], "GiB": r["device_total_bytes"] / GiB} for r in rows])
    curve = (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(x=alt.X(f"{name}:Q"), y=alt.Y("GiB:Q", title="device total GiB"))
    )
    line = alt.Chart(pd.DataFrame([{"cap": cap_gib}])).mark_rule(color="red").encode(y="cap:Q")
    return alt.layer(curve, line).properties(height=260)
