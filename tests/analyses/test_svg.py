"""The report's SVG figures: well-formed, every value where it belongs, every label escaped."""

import math
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest

from analyses import svg

NS = {"s": "http://www.w3.org/2000/svg"}
HOSTILE = '</svg><script>alert("x")</script>&'


def parse(markup: str) -> ET.Element:
    return ET.fromstring(markup)  # fails on anything but well-formed XML


def test_colours_interpolate_between_anchors():
    anchors = ("#000000", "#ff0080")
    assert svg.colour(anchors, 0) == "#000000" and svg.colour(anchors, 1) == "#ff0080"
    assert svg.colour(anchors, 0.5) == "#800040"
    assert svg.colour(anchors, -3) == "#000000" and svg.colour(anchors, 7) == "#ff0080"
    assert svg.colour(anchors, math.nan) == svg.MISSING
    assert svg.spread(svg.VIRIDIS, 3) == [svg.VIRIDIS[0], svg.VIRIDIS[4], svg.VIRIDIS[-1]]


def grid(values, title="t", star=None):
    frame = pd.DataFrame(values, index=pd.Index(range(len(values)), name="layer"))
    return svg.Grid(title, frame.rename_axis(columns="head"), star)


def test_a_heatmap_has_one_titled_cell_per_head_coloured_by_its_value():
    values = [[0.0, 0.5, 1.0], [1.0, math.nan, 0.25]]
    root = parse(svg.heatmaps([grid(values, HOSTILE, star=(1, 2))], vmin=0, vmax=1,
                              anchors=("#000000", "#ffffff"), label=HOSTILE, alt=HOSTILE,
                              name="h"))  # fmt: skip
    cells = {r.find("s:title", NS).text: r.get("fill") for r in root.iterfind(".//s:rect", NS)
             if r.find("s:title", NS) is not None}  # fmt: skip
    assert cells == {
        "layer 0, head 0: 0": "#000000",
        "layer 0, head 1: 0.5": "#808080",
        "layer 0, head 2: 1": "#ffffff",
        "layer 1, head 0: 1": "#ffffff",
        "layer 1, head 1: no value": svg.MISSING,
        "layer 1, head 2: 0.25": "#404040",
    }
    texts = [t.text for t in root.iterfind(".//s:text", NS)]
    assert texts.count(HOSTILE) == 2 and root.get("aria-label") == HOSTILE  # title and bar label
    star = next(t for t in root.iterfind(".//s:text", NS) if t.text == "★")
    titled = {r.find("s:title", NS).text: r for r in root.iterfind(".//s:rect", NS)
              if r.find("s:title", NS) is not None}  # fmt: skip
    cell = titled["layer 1, head 2: 0.25"]
    left, width = float(cell.get("x")), float(cell.get("width"))
    assert left < float(star.get("x")) < left + width


def test_small_multiples_share_one_scale_and_name_their_gradient():
    grids = [grid([[0.0, 1.0]]), grid([[2.0, 3.0]])]
    markup = svg.heatmaps(grids, vmin=0, vmax=3, anchors=svg.VIRIDIS, label="x", alt="a",
                          name="pair", columns=1)  # fmt: skip
    root = parse(markup)
    assert root.find(".//s:linearGradient", NS).get("id") == "pair-bar"
    fills = [
        r.get("fill") for r in root.iterfind(".//s:rect", NS) if r.find("s:title", NS) is not None
    ]
    assert fills == [svg.colour(svg.VIRIDIS, v / 3) for v in (0, 1, 2, 3)]
    assert markup == svg.heatmaps(
        grids, vmin=0, vmax=3, anchors=svg.VIRIDIS, label="x", alt="a", name="pair", columns=1
    )  # deterministic


def test_a_chart_puts_each_point_on_its_axes():
    series = [svg.Series(HOSTILE, [0, 1, 2], [0.0, 0.5, 1.0]), svg.Series("flat", [0, 2], [1, 1])]
    root = parse(svg.charts([svg.Chart("c", series, "x", "y")], alt="a", size=(200, 100)))
    frame = next(r for r in root.iterfind(".//s:rect", NS) if r.get("fill") == "none")
    x0, y0 = float(frame.get("x")), float(frame.get("y"))
    lines = root.findall(".//s:polyline", NS)
    assert [line.find("s:title", NS).text for line in lines] == [HOSTILE, "flat"]
    points = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    # x ticks 0…2, y ticks 0…1: the corners of the plotting area
    assert points[0] == (x0, y0 + 100) and points[2] == (x0 + 200, y0)
    assert points[1] == (x0 + 100, y0 + 50)
    circles = root.findall(".//s:circle", NS)
    assert len(circles) == 5 and circles[1].find("s:title", NS).text == f"{HOSTILE}: 1, 0.5"
    legend = [t.text for t in root.iterfind(".//s:text", NS)]
    assert HOSTILE in legend and "flat" in legend


def test_a_logarithmic_axis_leaves_out_what_it_cannot_show():
    series = [svg.Series("s", np.arange(4), [1.0, 0.1, 0.0, 0.001], markers=False)]
    root = parse(svg.charts([svg.Chart("c", series, "k", "v", log_y=True)], alt="a"))
    assert len(root.find(".//s:polyline", NS).get("points").split()) == 3
    labels = [t.text for t in root.iterfind(".//s:text", NS)]
    assert {"1e0", "1e-1", "1e-2", "1e-3"} <= set(labels)


def test_a_scatter_plot_draws_each_point_as_its_shape_on_a_logarithmic_x_axis():
    """Points without a line, one shape per series (titled, and keyed in the legend by that
    shape), on a logarithmic x axis of whole decades."""
    series = [svg.Series(HOSTILE, [100, 1000], [0.0, 1.0], "#123456", line=False, shape=shape)
              for shape in svg.SHAPES]  # fmt: skip
    chart = svg.Chart("c", series, "x", "y", log_x=True)
    root = parse(svg.charts([chart], alt="a", size=(200, 100)))
    assert root.find(".//s:polyline", NS) is None
    frame = next(r for r in root.iterfind(".//s:rect", NS) if r.get("fill") == "none")
    x0, y0 = float(frame.get("x")), float(frame.get("y"))
    titled = [e for e in root.iter() if e.find("s:title", NS) is not None]
    tags = [e.tag.split("}")[1] for e in titled]
    assert tags == ["circle"] * 2 + ["rect"] * 2 + ["polygon"] * 2 + ["line"] * 2
    assert {e.find("s:title", NS).text for e in titled} == {
        f"{HOSTILE}: 100, 0",
        f"{HOSTILE}: 1000, 1",
    }
    # x ticks 1e2…1e3: the first point at the left edge, the second at the right
    circles = root.findall(".//s:circle", NS)
    assert [(float(c.get("cx")), float(c.get("cy"))) for c in circles[:2]] == [
        (x0, y0 + 100), (x0 + 200, y0)]  # fmt: skip
    assert len(circles) == 3  # and one in the legend
    labels = [t.text for t in root.iterfind(".//s:text", NS)]
    assert {"1e2", "1e3"} <= set(labels) and labels.count(HOSTILE) == len(svg.SHAPES)
    with pytest.raises(ValueError, match="shape"):
        svg.charts([svg.Chart("c", [svg.Series("s", [1], [1], shape="star")], "x", "y")], alt="")


def test_a_categorical_axis_names_its_categories():
    series = [svg.Series("s", [-0.2, 0.8, 1.8], [1, 2, 3], line=False)]
    chart = svg.Chart("c", series, "task", "y", x_labels=["first", HOSTILE, "third"])
    root = parse(svg.charts([chart], alt="a", size=(300, 100)))
    frame = next(r for r in root.iterfind(".//s:rect", NS) if r.get("fill") == "none")
    x0 = float(frame.get("x"))
    ticks = {t.text: float(t.get("x")) for t in root.iterfind(".//s:text", NS) if t.get("x")}
    assert ticks["first"] == x0 + 50 and ticks[HOSTILE] == x0 + 150 and ticks["third"] == x0 + 250
    titles = [c.find("s:title", NS).text for c in root.findall(".//s:circle", NS)[:3]]
    assert titles == ["s: first, 1", f"s: {HOSTILE}, 2", "s: third, 3"]


def test_empty_charts_still_draw_their_axes():
    root = parse(svg.charts([svg.Chart("empty", [], "x", "y")], alt="a"))
    assert root.find(".//s:polyline", NS) is None and root.find(".//s:rect", NS) is not None


@pytest.mark.parametrize(("low", "high"), [(0, 5), (0, 0.6881), (-0.3, 2.2), (3, 3), (0, 31)])
def test_ticks_are_round_and_cover_the_range(low, high):
    ticks = svg._nice_ticks(low, high)
    assert ticks[0] <= low and ticks[-1] >= high and len(ticks) <= 12
    steps = np.diff(ticks)
    assert np.allclose(steps, steps[0])
    mantissa = steps[0] / 10 ** math.floor(math.log10(steps[0]))
    assert round(mantissa, 6) in (1, 2, 5)
