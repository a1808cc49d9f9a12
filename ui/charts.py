"""What every line chart's axes say: plain numbers.

Vega formats each tick with the ticks' own precision: "~g" then counted significant digits and wrote steps 100
and 120 as "1e+2" and "1.2e+2", minutes as "1e+1". "~f" counts decimals instead: "100", "120", "0.5", "0.0002".
"""

import altair as alt

PLAIN = ",~f"


def axis(whole: bool = False, **kw) -> alt.Axis:
    """An axis in plain numbers; `whole`: a count (steps, a batch size) never gets a tick between two numbers."""
    return alt.Axis(format=PLAIN, **({"tickMinStep": 1} if whole else {}), **kw)
