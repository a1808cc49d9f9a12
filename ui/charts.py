"""What every line chart's axes say: plain numbers.

Vega formats each tick with the ticks' own precision: "~g" then counted significant digits and wrote steps 100
and 120 as "1e+2" and "1.2e+2", minutes as "1e+1". "~f" counts decimals instead: "100", "120", "0.5", "0.0002".
And the Monitor's line charts, whose specs are written once per shape (line_spec).
"""

import functools

import altair as alt
import pandas as pd

PLAIN = ",~f"


def axis(whole: bool = False, **kw) -> alt.Axis:
    """An axis in plain numbers; `whole`: a count (steps, a batch size) never gets a tick between two numbers."""
    return alt.Axis(format=PLAIN, **({"tickMinStep": 1} if whole else {}), **kw)


def lines_chart(
    df: pd.DataFrame,
    x: str,
    title: str,
    y_title: str,
    height: int = 330,
    faint_raw: bool = False,
    y_scale=None,
) -> alt.Chart:
    """`faint_raw`: each figure in one hue, its raw training points see-through under its "(smoothed)" curve
    (the legend names the figures, not every curve: a third of the page has no room for seven names)."""
    chart, color, extra, legend = alt.Chart(df), "series:N", {}, {}
    if faint_raw:
        chart = chart.transform_calculate(figure="replace(datum.series, ' (smoothed)', '')")
        color, extra["detail"] = "figure:N", "series:N"
        legend["columns"] = 2
        smoothed_or_eval = "indexof(datum.series, '(smoothed)') >= 0 || indexof(datum.series, 'eval') == 0"
        extra["opacity"] = alt.condition(smoothed_or_eval, alt.value(1.0), alt.value(0.3))
    return (
        # a series of one or two points draws its points (a line of one point shows nothing)
        chart.mark_line(
            interpolate="linear", strokeWidth=1.5, point=len(df) <= 2 * max(1, df["series"].nunique())
        )
        .encode(
            alt.X(f"{x}:Q", title=x, axis=axis(whole=x == "step")),  # "120", not "1.2e+2"
            alt.Y("value:Q", title=y_title, scale=y_scale or alt.Scale(zero=False), axis=axis()),
            # distinct hues (train, smoothed, eval must not be three blues)
            alt.Color(
                color,
                title=None,
                scale=alt.Scale(scheme="tableau10"),
                legend=alt.Legend(orient="top", direction="horizontal", **legend),
                # in the frame's order (chosen, rejected, margin, eval), not alphabetical: the eval margin's hue
                # then stands apart from the margin's
                **({"sort": None} if faint_raw else {}),
            ),
            tooltip=[x, "value", "series"],
            **extra,
        )
        .properties(title=title, height=height)
    )


@functools.lru_cache(maxsize=64)
def line_spec(
    x: str, title: str, y_title: str, points: bool, height: int = 330, faint_raw: bool = False
) -> dict:
    """_lines' Vega-Lite spec without its data. Altair validates a chart against its schema as it writes the spec
    (~10-20 ms a chart); a live run's page redraws every chart every tick, so it is written once per shape."""
    shape = pd.DataFrame({x: [0.0] * (1 if points else 3), "value": 0.0, "series": ""})
    spec = lines_chart(shape, x, title, y_title, height=height, faint_raw=faint_raw).to_dict()
    spec.pop("datasets", None)
    spec.pop("data", None)
    return spec
