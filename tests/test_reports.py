"""Reports of a plan: the JSON data, the simulated timeline, HTML, Markdown, PNG charts, Chrome traces."""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from PIL import Image

import autopipe
from autopipe.planning.plan import Plan
from autopipe.planning.plan_records import ScheduleAlternative
from autopipe.reporting.charts import (alternatives_figure, figure_svg, layer_cost_figure, report_figures,
                                       save_pngs, timeline_figure)
from autopipe.reporting.chrome import merge_rank_traces, simulated_trace, trace_ranks
from autopipe.reporting.data import layer_rows, report_data, sort_layer_rows
from autopipe.reporting.files import check_writable, report_format, write_report
from autopipe.reporting.html import plan_to_html
from autopipe.reporting.markdown import plan_to_markdown
from autopipe.reporting.tables import stage_table
from autopipe.reporting.terminal import make_console, print_layers, print_plan
from autopipe.reporting.timeline import cut_comm_s, plan_timeline, split_timeline

VOID_TAGS = {"meta", "br", "hr", "img", "input", "link"}


@pytest.fixture(scope="module")
def plan(small_transformer, small_costs_once):
    # Counted costs on the CPU's links: the same plan, so the same reports, on every machine.
    model, args = small_transformer
    return autopipe.partition(model, 2, args,
                              planner=autopipe.PlannerOptions(memory="64MiB", cost=copy.deepcopy(small_costs_once), profiling=autopipe.ProfileOptions(device="cpu", progress=False)))


@pytest.fixture(scope="module")
def interleaved_plan(small_transformer, small_costs_once):
    model, args = small_transformer
    return autopipe.partition(model, 2, args, schedule="Interleaved1F1B", n_microbatches=4,
                              planner=autopipe.PlannerOptions(stages_per_rank=2, cost=copy.deepcopy(small_costs_once), profiling=autopipe.ProfileOptions(device="cpu", progress=False)))


@pytest.fixture(scope="module")
def data(plan):
    return report_data(plan)


def _with_alternatives(plan: Plan) -> Plan:
    p = copy.deepcopy(plan)
    p.alternatives = [
        ScheduleAlternative(schedule=p.schedule, n_microbatches=p.n_microbatches, stages_per_rank=1,
                            predicted_step_s=p.predicted_step_s, peak_bytes=1000, fits=True),
        ScheduleAlternative(schedule="GPipe", n_microbatches=p.n_microbatches, stages_per_rank=1,
                            predicted_step_s=p.predicted_step_s * 1.3, peak_bytes=2000, fits=False, note="too big"),
        ScheduleAlternative(schedule="DualPipeV", n_microbatches=p.n_microbatches, stages_per_rank=2,
                            predicted_step_s=None, peak_bytes=None, fits=False, note="needs more micro-batches"),
    ]
    return p


class _BalanceChecker(HTMLParser):
    """Fails on a closing tag that does not match the open one."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID_TAGS:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


# --------------------------------------------------------------------------- timeline and data


def test_simulated_timeline_reproduces_the_plans_predicted_step(plan):
    # The timeline holds the schedule's actions; the prediction adds the once-per-step tail.
    assert plan.step_tail_s() > 0  # a CPU plan's last stage merges its outputs, at least
    assert plan_timeline(plan).step_s + plan.step_tail_s() == pytest.approx(plan.predicted_step_s, rel=1e-9)


def test_simulated_timeline_of_an_interleaved_plan_reproduces_its_prediction(interleaved_plan):
    timeline = plan_timeline(interleaved_plan)
    assert timeline.step_s + interleaved_plan.step_tail_s() == pytest.approx(interleaved_plan.predicted_step_s,
                                                                             rel=1e-9)
    assert timeline.n_ranks == 2 and timeline.n_stages == 4


def test_split_timeline_of_a_baseline_reproduces_its_predicted_step(plan):
    baseline = plan.baselines[0]
    # No tied weights here, so every split has the plan's once-per-step tail.
    assert split_timeline(plan, baseline.split_points).step_s + plan.step_tail_s() == pytest.approx(
        baseline.predicted_step_s, rel=1e-9)


def test_split_timeline_refuses_a_split_point_that_is_no_segment(plan):
    with pytest.raises(ValueError, match="unknown: \\['nowhere'\\]"):
        split_timeline(plan, ["nowhere"])


def test_cut_comm_is_charged_once_per_cut(plan):
    comm = cut_comm_s(plan)
    assert len(comm) == plan.num_stages - 1
    assert all(c > 0 for c in comm)


def test_report_data_is_json_and_holds_the_plan(plan, data):
    text = json.dumps(data)
    again = Plan.from_dict(json.loads(text)["plan"])
    assert again.split_points == plan.split_points
    assert data["summary"]["predicted_step_s"] == plan.predicted_step_s


def test_report_data_gives_every_layer_the_stage_it_lands_in(plan, data):
    stages = [layer["stage"] for layer in data["layers"]]
    assert stages == sorted(stages)
    assert stages.count(1) == plan.stages[1].last_segment - plan.stages[1].first_segment + 1


def test_report_data_gives_each_stage_its_share_of_the_memory_limit(plan, data):
    assert [s["capacity_bytes"] for s in data["stages"]] == [64 * 2**20] * plan.num_stages


def test_report_data_rates_each_baseline_against_the_plan(plan, data):
    for b, row in zip(plan.baselines, data["baselines"]):
        if b.reason:  # not applicable: no split to rate
            continue
        assert row["slowdown"] == pytest.approx(b.predicted_step_s / plan.predicted_step_s)


def test_report_data_keeps_the_planners_alternatives(plan):
    data = report_data(_with_alternatives(plan))
    assert [a["schedule"] for a in data["alternatives"]] == [plan.schedule, "GPipe", "DualPipeV"]


def test_layer_rows_follow_graph_order_and_sort_by_time(small_traced):
    from autopipe.planning.profile import profile_segments

    costs = profile_segments(small_traced, warmup=0, repeats=1, progress=False)
    rows = layer_rows(small_traced, costs)
    assert [r["index"] for r in rows] == list(range(small_traced.num_segments))
    by_time = sort_layer_rows(rows, "time")
    assert [r["fwd_s"] + r["bwd_s"] for r in by_time] == sorted((r["fwd_s"] + r["bwd_s"] for r in rows), reverse=True)


def test_sorting_layers_by_an_unknown_key_names_the_known_ones():
    with pytest.raises(ValueError, match="sort='speed'.*graph"):
        sort_layer_rows([], "speed")


# --------------------------------------------------------------------------- tables and terminal


def test_stage_table_has_a_capacity_column_only_with_a_memory_limit(data, interleaved_plan):
    assert "capacity" in stage_table(data).header
    assert "capacity" not in stage_table(report_data(interleaved_plan)).header


def test_terminal_report_shows_split_spec_stages_baselines_and_timeline(plan, data, capsys):
    print_plan(data, console=make_console(), gantt=plan_timeline(plan).to_text())
    out = capsys.readouterr().out
    assert f'"{plan.split_points[0]}": SplitPoint.BEGINNING' in out
    assert "Stages (times per micro-batch)" in out and "deepspeed_uniform" in out
    assert "rank 0 |" in out and "rank 1 |" in out


def test_terminal_layer_table_lists_every_row(data, capsys):
    print_layers(data["layers"], console=make_console())
    out = capsys.readouterr().out
    assert all(layer["name"].split(".")[-1] in out for layer in data["layers"][1:])


def test_terminal_report_lists_alternatives_when_the_planner_weighed_them(plan, capsys):
    print_plan(report_data(_with_alternatives(plan)), console=make_console())
    out = capsys.readouterr().out
    assert "Alternatives considered" in out and "needs more micro-batches" in out


# --------------------------------------------------------------------------- HTML and Markdown


def test_html_report_is_well_formed_and_self_contained(data):
    html = plan_to_html(data)
    ET.fromstring(html[html.index("<html"):])  # well-formed XML, so any HTML parser reads it
    checker = _BalanceChecker()
    checker.feed(html)
    assert checker.stack == []
    assert "src=\"http" not in html and "<script" not in html and "<link" not in html


def test_html_report_embeds_one_svg_per_figure(data):
    html = plan_to_html(data)
    assert html.count("<svg") == len(report_figures(data))


def test_html_report_escapes_layer_names(data):
    html = plan_to_html(data, figures=False)
    assert "&lt;input&gt;" in html and "<input>" not in html


def test_html_report_shows_the_split_spec_and_each_baseline(plan, data):
    html = plan_to_html(data, figures=False)
    assert f"&quot;{plan.split_points[0]}&quot;: SplitPoint.BEGINNING" in html
    assert all(b.name in html for b in plan.baselines)


def test_markdown_report_links_the_pngs_it_was_given(data):
    text = plan_to_markdown(data, images={"timeline": "r_files/timeline.png"})
    assert "![Gantt chart of one simulated step](r_files/timeline.png)" in text
    assert "stages.png" not in text


def test_markdown_report_tables_have_one_row_per_stage(plan, data):
    text = plan_to_markdown(data)
    stage_section = text.split("## Stages")[1].split("##")[0]
    rows = [line for line in stage_section.splitlines() if line.startswith("| ") and not line.startswith("| stage")]
    assert len(rows) == plan.num_stages


def test_write_report_picks_the_format_from_the_suffix(data, tmp_path):
    assert write_report(data, tmp_path / "r.json") == [tmp_path / "r.json"]
    assert json.loads((tmp_path / "r.json").read_text())["summary"] == data["summary"]
    md_files = write_report(data, tmp_path / "r.md")
    assert md_files[0] == tmp_path / "r.md"
    assert all(p.exists() for p in md_files) and any(p.suffix == ".png" for p in md_files)


def test_report_format_rejects_an_unknown_suffix_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"'\.pdf'.*\.html.*\.md.*\.json"):
        report_format("report.pdf")


def test_check_writable_rejects_a_path_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="--out.*is not a folder"):
        check_writable(tmp_path / "file" / "plan.json", what="--out")


def test_check_writable_rejects_a_folder_where_a_file_is_wanted(tmp_path):
    with pytest.raises(OSError, match="is a folder"):
        check_writable(tmp_path, what="--report")


# --------------------------------------------------------------------------- charts


def test_save_pngs_writes_decodable_images(data, tmp_path):
    paths = save_pngs(data, tmp_path)
    assert sorted(paths) == ["baselines", "layers", "stages", "timeline"]
    for path in paths.values():
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] > 400 and im.size[1] > 150


def test_alternatives_figure_only_when_the_plan_has_alternatives(plan, data):
    assert alternatives_figure(data) is None
    assert alternatives_figure(report_data(_with_alternatives(plan))) is not None


def test_timeline_figure_draws_one_row_per_rank(interleaved_plan):
    fig = timeline_figure(report_data(interleaved_plan)["timeline"])
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["rank 0", "rank 1"]


def test_layer_cost_figure_refuses_an_empty_profile():
    with pytest.raises(ValueError, match="layers is empty"):
        layer_cost_figure([])


def test_figure_svg_is_an_inline_svg_element(data):
    svg = figure_svg(timeline_figure(data["timeline"]))
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")


# --------------------------------------------------------------------------- Chrome traces


def test_simulated_trace_has_one_track_per_rank(interleaved_plan):
    trace = json.loads(json.dumps(simulated_trace(interleaved_plan)))
    assert trace_ranks(trace) == {0, 1}
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}


def test_simulated_trace_names_the_plan(plan):
    other = simulated_trace(plan)["otherData"]
    assert other["split_points"] == ", ".join(plan.split_points)


def test_merge_rank_traces_puts_each_rank_in_its_own_process_from_time_zero(tmp_path):
    rank_traces = [
        {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 4242, "args": {"name": "python"}},
                         {"name": "step", "ph": "X", "pid": 4242, "tid": 1, "ts": 1000.0 + 10 * r, "dur": 5.0}]}
        for r in range(2)
    ]
    (tmp_path / "rank1.json").write_text(json.dumps(rank_traces[1]))
    merged = merge_rank_traces([rank_traces[0], tmp_path / "rank1.json"])
    steps = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"]) for e in steps] == [(0, 0.0), (1, 10.0)]
    assert trace_ranks(merged) == {0, 1}


def test_merge_rank_traces_refuses_something_that_is_not_a_trace():
    with pytest.raises(ValueError, match=r"traces\[0\] has no 'traceEvents'"):
        merge_rank_traces([{"events": []}])


def test_reports_say_what_the_step_spends_around_its_actions(plan):
    from autopipe.reporting.data import report_data
    from autopipe.reporting.markdown import plan_to_markdown

    data = report_data(plan)
    assert data["summary"]["step_tail_s"] == {"merge_outputs_s": plan.step_tail.merge_outputs_s,
                                              "loss_broadcast_s": plan.step_tail.loss_broadcast_s,
                                              "shared_grads_s": plan.step_tail.shared_grads_s,
                                              "start_agreement_s": plan.step_tail.start_agreement_s}
    text = plan_to_markdown(data)
    assert f"spends {plan.step_tail_s() * 1e3:.2f} ms once" in text and "loss broadcast" in text
    assert "start agreement" in text
    # A training step keeps no outputs (torch 2.10 and later), so there is no merge to report.
    assert ("merge outputs" in text) == (plan.step_tail.merge_outputs_s > 0)
