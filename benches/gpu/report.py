"""The report: the JSON file (rewritten whole after every section) and the summary table printed at
the end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial_path = path.with_suffix(".partial")
    partial_path.write_text(json.dumps(report, indent=1, default=str))
    os.replace(partial_path, path)


def fmt(value: Any, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def micros(ms: float | None) -> float | None:
    return ms * 1e3 if ms is not None else None


def problem(record: dict[str, Any]) -> str:
    return str(record.get("error") or record.get("skipped") or "")


def sweep_line(times: dict[str, float | None]) -> str:
    """``exact_sweep``'s times in microseconds, one ``form value`` pair each."""
    return ", ".join(f"{form} {fmt(micros(ms))}" for form, ms in times.items())


def differs(row: dict[str, Any], flag: str) -> str:
    """``!`` where the row's ``flag`` (logits equal) is false."""
    return "!" if row.get(flag) is False else ""


def one_row_forms_cell(row: dict[str, Any]) -> str:
    """A one-row decode row's other split-GEMV forms (``graphs_one_row_forms``): each one's tok/s over
    the default's, ``!`` where its logits differ from eager's."""
    forms = row.get("one_row_forms") or {}
    return " ".join(f"{k.removeprefix('gemv_') if k != 'gemv' else k} {fmt(f.get('over_default'), '.2f')}"
                    f"{'' if f.get('logits_equal') else '!'}" for k, f in forms.items()) or "-"  # fmt: skip


def kernels_line(row: dict[str, Any], top: int = 6) -> str:
    """A decode row's device time per step (``gpu.kernels``): the sum, its share of a graph step, and
    the largest kernels with their launches per step."""
    if row.get("kernels_error"):
        return f"kernels: {row['kernels_error']}"
    parts = [f"{k['name'][:32]} {fmt(k['us'])} us x{fmt(k['launches'], '.0f')}" for k in row["kernels"][:top]]
    matmuls = ", ".join(f"{role} {fmt(us)}" for role, us in row.get("matmuls", {}).items())
    by_matrix = f"; Q1 matmuls by matrix, us: {matmuls}" if matmuls else ""
    return (f"kernels: {fmt(row.get('busy_us'))} us/step busy ({fmt(row.get('graph_busy_fraction'), '.2f')} "
            f"of a graph step): " + ", ".join(parts) + by_matrix)  # fmt: skip


def table_lines(report: dict[str, Any]) -> list[str]:
    p = report.get("probe", {})
    lines = [f"probe: {p.get('name', p.get('device', '-'))}  D2D {fmt(p.get('d2d_gbps'))} GB/s  "
             f"H2D {fmt(p.get('h2d_gbps'))}  D2H {fmt(p.get('d2h_gbps'))}  PDL {p.get('pdl', '-')}  "
             f"{problem(p)}"]  # fmt: skip
    lines.append(f"q1 {'shape':<22} {'M':>4} {'us':>9} {'GB/s':>8} {'/B1':>6} {'xB2':>6} {'rel_err':>8} "
                 f"{'float us':>9} {'=cpu':>5}")  # fmt: skip
    for r in report.get("q1", {}).get("rows", []):
        lines.append(f"   {r['shape']:<22} {r.get('m', ''):>4} {fmt(micros(r.get('ours_ms'))):>9} "
                     f"{fmt(r.get('ours_gbps')):>8} {fmt(r.get('ours_over_b1'), '.2f'):>6} "
                     f"{fmt(r.get('speedup_vs_b2'), '.2f'):>6} {fmt(r.get('rel_err'), '.1e'):>8} "
                     f"{fmt(micros(r.get('float_ms'))):>9} {r.get('equals_cpu_engine', '-')!s:>5} "
                     f"{problem(r)}")  # fmt: skip
        if r.get("sweep_ms"):
            lines.append(f"{'':<8}sweep us: {sweep_line(r['sweep_ms'])} (default {r.get('sweep_default')})")
    if report.get("q1", {}).get("tuned_table"):
        lines.append(f"q1 tuned table (forms that beat the defaults): {report['q1']['tuned_table']}")
    lines.append(f"model {'name':<13} {'phase':<8} {'batch':>5} {'tok/s':>10} {'B2 tok/s':>10} {'xB2':>6} "
                 f"{'graph':>10} {'xeager':>6} {'B2 graph':>10} {'xB2':>6} {'same':>5} {'other PDL':>10} "
                 f"{'xPDL':>5} {'xfuse':>5} {'xtuned':>6} {'xmerge':>6} "
                 f"{'x(other one-row GEMV)':<21}")  # fmt: skip
    for m in report.get("decode", {}).get("models", []):
        for r in m.get("results", [{"phase": "-", "batch": "-"}]):
            other_pdl = r.get("no_pdl_graph_tok_s", r.get("all_pdl_graph_tok_s"))  # graphs_other_pdl
            lines.append(f"      {m['model']:<13} {r['phase']:<8} {r['batch']:>5} "
                         f"{fmt(r.get('ours_tok_s')):>10} {fmt(r.get('b2_tok_s')):>10} "
                         f"{fmt(r.get('speedup_vs_b2'), '.2f'):>6} {fmt(r.get('graph_tok_s')):>10} "
                         f"{fmt(r.get('graph_vs_eager'), '.2f'):>6} {fmt(r.get('b2_graph_tok_s')):>10} "
                         f"{fmt(r.get('graph_speedup_vs_b2'), '.2f'):>6} "
                         f"{r.get('graph_logits_equal', '-')!s:>5} {fmt(other_pdl):>10} "
                         f"{fmt(r.get('pdl_gain'), '.2f'):>5} {fmt(r.get('fuse_gain'), '.2f'):>5} "
                         f"{fmt(r.get('tuned_gain'), '.2f'):>5}{differs(r, 'tuned_logits_equal'):1} "
                         f"{fmt(r.get('merge_gain'), '.2f'):>5}{differs(r, 'merged_logits_equal'):1} "
                         f"{one_row_forms_cell(r):<21} {problem(m) or problem(r)}")  # fmt: skip
            if r.get("kernels") or r.get("kernels_error"):
                lines.append(f"{'':<8}{kernels_line(r)}")
    e = report.get("engine", {})
    v = e.get("vs_native_cpu", {})
    lines.append(f"engine: logits vs the native CPU runner: median rel L2 "
                 f"{fmt(v.get('median_rel_l2'), '.1e')}, top-1 agreement "
                 f"{fmt(v.get('top1_agreement'), '.2f')} {problem(e)}")  # fmt: skip
    for r in e.get("rows", []):
        lines.append(f"   batch {r['batch']:>3}: graphs {fmt(r.get('graph_tok_s'))} tok/s, eager "
                     f"{fmt(r.get('eager_tok_s'))} ({fmt(r.get('graph_over_eager'), '.2f')}x), float graphs "
                     f"{fmt(r.get('float_graph_tok_s'))}, planned after the tokens "
                     f"{fmt(r.get('planned_after_tok_s'))} (ahead {fmt(r.get('ahead_gain'), '.2f')}x), "
                     f"output after them too {fmt(r.get('output_after_tok_s'))} "
                     f"(overlap {fmt(r.get('overlap_gain'), '.2f')}x); same tokens {r.get('same_tokens')} "
                     f"(ahead {r.get('ahead_same_tokens')}, overlap {r.get('overlap_same_tokens')}), "
                     f"batch-invariant {r.get('batch_invariant')} "
                     f"(float {r.get('float_batch_invariant')})")  # fmt: skip
    t = report.get("tier", {})
    pr, tt = t.get("promote", {}), t.get("ttft", {})
    lines.append(f"tier: promote {fmt(pr.get('promote_gbps'))} GB/s vs one large H2D "
                 f"{fmt(pr.get('large_h2d_gbps'))} ({fmt(pr.get('promote_over_large'), '.2f')}); "
                 f"TTFT cold {fmt(tt.get('cold_ttft_ms'))} ms, promoted {fmt(tt.get('promoted_ttft_ms'))} ms "
                 f"({fmt(tt.get('promoted_over_cold'), '.2f')}) "
                 f"{problem(pr)} {problem(tt)}")  # fmt: skip
    pf = t.get("prefetch", {})
    lines.append(f"tier: queued behind a full step, TTFT with prefetch "
                 f"{fmt(pf.get('queued_ttft_prefetch_ms'))} ms, "
                 f"without {fmt(pf.get('queued_ttft_no_prefetch_ms'))} ms "
                 f"({fmt(pf.get('prefetch_over_no_prefetch'), '.2f')}); all prefetched "
                 f"{pf.get('all_prefixes_prefetched')}, same tokens {pf.get('same_tokens')} "
                 f"{problem(pf)}")  # fmt: skip
    lines.append(f"tier: arriving beside {pf.get('arrival_decoders')} decoders, TTFT with prefetch "
                 f"{fmt(pf.get('arrival_ttft_ms_prefetch'))} ms ({pf.get('arrival_decoder_tokens_prefetch')} "
                 f"decoder tokens meanwhile), without {fmt(pf.get('arrival_ttft_ms_no_prefetch'))} ms "
                 f"({pf.get('arrival_decoder_tokens_no_prefetch')})")  # fmt: skip
    return lines
